"""A quiet console: eagle3x's own lines, progress bars and errors; the libraries' output goes
to the job's log file.

`quiet(log_file)` points file descriptors 1 and 2 at the job's log file (Hydra's
``<run dir>/eagle3x.log``), so whatever vLLM's engine processes, Lightning, transformers,
Python warnings or C++ code print lands there, in full. The console keeps a duplicate of
the original descriptors: Hydra's console handler writes to it, passing eagle3x's records
(INFO and up) and any library's ERROR; progress bars write to `stream()`. With
``log.libraries=true`` (or ``hydra.verbose``) nothing is redirected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import IO, Iterator, List, Optional, Tuple

_console: Optional[IO[str]] = None
_stdout: Optional[IO[str]] = None


def stream() -> IO[str]:
    """Where progress bars go: the console while `quiet` holds, else stderr."""
    return _console if _console is not None else sys.stderr


def stdout() -> IO[str]:
    """The command's own standard output (what a caller reads, e.g. stage=serve's URL),
    also while `quiet` sends the libraries' output to the log file."""
    return _stdout if _stdout is not None else sys.stdout


def is_terminal() -> bool:
    try:
        return stream().isatty()
    except (AttributeError, ValueError):
        return False


class _OwnLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] == "eagle3x" or record.levelno >= logging.ERROR


def job_log_file() -> Optional[Path]:
    """The file Hydra's job logging writes (None when there is none)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return Path(h.baseFilename)
    return None


@contextlib.contextmanager
def quiet(log_file: Optional[Path]) -> Iterator[None]:
    """Libraries' output to `log_file` for the duration (no-op when it is None)."""
    global _console, _stdout
    if log_file is None or _console is not None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
    err = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    target = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    own = _OwnLines()
    swapped: List[Tuple[logging.StreamHandler, IO[str]]] = []
    for h in logging.getLogger().handlers:
        if type(h) is logging.StreamHandler:
            swapped.append((h, h.stream))
            h.setStream(out if h.stream is sys.stdout else err)
            h.addFilter(own)
    logging.captureWarnings(True)
    os.dup2(target, 1)
    os.dup2(target, 2)
    _console, _stdout = err, out
    try:
        yield
    finally:
        _console = _stdout = None
        for f in (sys.stdout, sys.stderr, out, err):
            with contextlib.suppress(Exception):
                f.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for h, old in swapped:
            h.setStream(old)
            h.removeFilter(own)
        logging.captureWarnings(False)
        for fd in (*saved, target):
            os.close(fd)
        out.close()
        err.close()
