"""Placeholder for `datasets` (bench/peer_stubs/README.md): importable, never usable."""

import sys

from _placeholder import fill, install

fill(sys.modules[__name__])
install("datasets")
