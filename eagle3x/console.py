"""A quiet console: eagle3x's own lines, progress bars and errors; the libraries' output goes
to the job's log file.

`quiet(log_file)` points file descriptors 1 and 2 at the job's log file (Hydra's
``<run dir>/eagle3x.log``), so whatever vLLM's engine processes, Lightning, transformers,
Python warnings or C++ code print lands there, in full. The console keeps a duplicate of
the original descriptors: Hydra's console handler writes to it, passing eagle3x's records
(INFO and up, except those marked ``extra=LOG_ONLY``: a traceback, a progress line the
terminal shows as a bar) and any library's ERROR; progress bars write to `stream()`. With
``log.libraries=true`` (or ``hydra.verbose``) nothing is redirected.

`progress(...)` is the one progress display of a long loop: a bar on a terminal, a line
every `every` seconds otherwise (a job log, ``nohup``, SLURM), which also goes to the
job's log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

_console: Optional[IO[str]] = None
_stdout: Optional[IO[str]] = None
_log_file: Optional[Path] = None
#: `log.info(..., extra=LOG_ONLY)`: the job's log file gets the record, the console not.
LOG_ONLY = {"log_only": True}


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


def log_file() -> Optional[Path]:
    """The file the libraries' output goes to while `quiet` holds (None otherwise: then
    their lines are on the console, not in a file eagle3x could read)."""
    return _log_file


def log_size() -> int:
    """How many bytes the redirected log file holds now (0 when there is none): where
    the lines a stage is about to cause start."""
    try:
        return _log_file.stat().st_size if _log_file is not None else 0
    except OSError:
        return 0


def log_since(offset: int, limit: int = 1 << 20) -> str:
    """What the redirected log file gained after `offset` (its last `limit` bytes)."""
    if _log_file is None:
        return ""
    try:
        with open(_log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(offset, end - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


class _OwnLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "log_only", False):
            return False
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
    global _console, _stdout, _log_file
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
    _console, _stdout, _log_file = err, out, Path(log_file)
    try:
        yield
    finally:
        _console = _stdout = _log_file = None
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


def duration(seconds: float) -> str:
    """3.2s, 4m05s, 2h03m."""
    s = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Lines:
    """A progress display off a terminal: one log line every `every` seconds (and a last
    one when there were any), "extract: 96/320 samples (30%), 812 tok/s, 1m02s elapsed,
    ETA 2m25s"."""

    def __init__(self, total: int, desc: str, unit: str, initial: int, every: float):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.n = self.start = initial
        self.t0 = self.last = time.perf_counter()
        self.rate_t0, self.rate_n = self.t0, initial  # where the ETA's rate is measured from
        self.postfix: Dict[str, Any] = {}
        self.lines = 0
        self.shown = -1  # the count the last line showed

    def update(self, n: int) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._line(now)

    def set_postfix(self, **kw: Any) -> None:
        self.postfix.update(kw)

    def rate_from_now(self) -> None:
        """Measure the ETA's rate from here on (after an engine start, which is elapsed
        time but no progress)."""
        self.rate_t0, self.rate_n = time.perf_counter(), self.n

    def _line(self, now: float) -> None:
        took = now - self.t0
        done, rate_took = self.n - self.rate_n, now - self.rate_t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = "".join(f", {v} {k.replace('_', '/')}" for k, v in self.postfix.items())
        eta = (f", ETA {duration(rate_took / done * (self.total - self.n))}"
               if done > 0 and self.total and self.n < self.total else "")
        self.lines += 1
        self.shown = self.n
        logging.getLogger("eagle3x").info("%s: %d/%d %s%s%s, %s elapsed%s", self.desc, self.n,
                                          self.total, self.unit, pct, extra, duration(took), eta)

    def close(self) -> None:
        # a last line only if something changed since the last one (else the same count
        # twice, with two rates)
        if self.lines and self.last != -1.0 and self.n != self.shown:
            self._line(time.perf_counter())
        self.last = -1.0


def progress(total: int, desc: str, unit: str, initial: int = 0, every: float = 30.0) -> Any:
    """A progress display with tqdm's `update(n)`, `set_postfix(**kw)`, `close()`: tqdm's
    bar on a terminal, a line every `every` seconds elsewhere (and one at the end)."""
    if is_terminal():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                    file=stream(), mininterval=0.5)
    return _Lines(total, desc, unit, initial, every)
