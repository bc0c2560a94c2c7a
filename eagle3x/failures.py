"""How a stage that does not finish says so: `Stopped`, and signal names.

A stage that stops early on purpose (SIGTERM or SIGINT: a scheduler preempting the job, a
user's `kill`) or for a reason it can name raises `Stopped(reason, exit_code)`; the
pipeline (``eagle3x.pipeline.run``) turns it, and an engine's death
(``eagle3x.engines.base.EngineFailed``), into one line on the console: what stopped and
why, what is kept, and the command that continues. The traceback, when there is one,
goes to the job's log file; the process exits with `exit_code` (never 0).
"""

from __future__ import annotations

import signal
import sys
from typing import Callable, Optional


class Stopped(Exception):
    """A stage stopped before its end; `reason` says why ("by SIGTERM at step 17")."""

    def __init__(self, reason: str, exit_code: int = 1, kept: Optional[str] = None):
        super().__init__(reason)
        self.reason, self.exit_code, self.kept = reason, exit_code, kept


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_exit(signum: int) -> int:
    """The status a shell reports for a process ended by `signum`: 128 + its number."""
    return 128 + int(signum)


def exit_code_meaning(code: int) -> str:
    """'killed by SIGKILL, ...' for -9 (or 137), else 'exit code 3'."""
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        why = f"killed by {signal_name(num)}"
        if num == signal.SIGKILL:
            why += ", as the kernel's out-of-memory killer does"
        return why
    return f"exit code {code}"


#: Set by the pipeline while a job runs: prints a stop's one console line (with what is
#: kept and the command that continues) and returns the exit status.
_reporter: Optional[Callable[[BaseException, Optional[str]], int]] = None


def set_reporter(fn: Optional[Callable[[BaseException, Optional[str]], int]]) -> None:
    global _reporter
    _reporter = fn


def report(exc: BaseException, stage: Optional[str] = None) -> int:
    """Report `exc` the pipeline's way (from a thread that must end the process itself:
    the rank watch); the exit status."""
    if _reporter is not None:
        return _reporter(exc, stage)
    sys.stderr.write(f"eagle3x: {exc}\n")
    return int(getattr(exc, "exit_code", 1))
