"""bench/code_prompts.py: the code prompt set is the same text on every run of one Python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
code_prompts = pytest.importorskip("code_prompts")


def test_no_prompt_carries_an_object_address():
    """A default argument that is an object (shutil.move's copy_function) prints as
    `<function copy2 at 0x7f...>`: the address changes from process to process, and so
    would the set's text and digest."""
    prompts = code_prompts.build(320, 0)
    assert len(prompts) == 320
    signatures = [f[2] for f in code_prompts.functions()]
    assert any("<function" in s for s in signatures)  # such defaults are still asked about
    assert not [s for s in signatures if " at 0x" in s]
    assert not [p["id"] for p in prompts if "0x" in p["messages"][0]["content"]]
