"""A wait on vLLM's engine processes that ends when they die.

vLLM 0.32's synchronous client waits for the answer to a utility call on a future with no
timeout (vllm/v1/engine/core_client.py, ``SyncMPClient.call_utility``): ``LLM.collective_rpc``
and the calls ``vllm.LLM`` makes once its engine is up. When the engine process dies before
it answers (its worker killed: the engine core sends ENGINE_CORE_DEAD and exits), the client
marks itself dead, but nothing fails that future: the main process waits forever, silent.
Calls that read the output queue (``generate``) do fail, with EngineDeadError.

``lifeline()`` guards a block of the main thread. It lists the processes vLLM names
``VLLM::...`` (its engine core and workers set that process title) under this process as
the block starts, and a watcher thread looks again every `poll` seconds. Once one that it saw running is gone or a zombie and the block
still runs `grace` seconds later (vLLM's own error path had its chance), the main thread
gets ``EngineDied`` naming that process: a signal (``SIGNAL``) interrupts its wait and the
handler raises there. Outside the main thread, or inside another lifeline, the block runs
unguarded. The handler stays installed once set, and raises only for a lifeline whose block
is still running, so a signal that arrives late is ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

#: the signal that wakes the main thread (a real-time one: nothing else here sends it)
SIGNAL = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
PREFIX = "VLLM::"
#: seconds between looks at the processes; seconds a death may go unanswered by vLLM itself
POLL, GRACE = 0.5, 10.0


class EngineDied(RuntimeError):
    """An engine process died while the main thread waited for it."""


def vllm_processes() -> List[Tuple[int, str, Callable[[], bool]]]:
    """(pid, title, alive) for each process under this one whose title starts with VLLM::
    (none without psutil, which vLLM itself requires)."""
    try:
        import psutil
    except ImportError:
        return []

    out = []
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return out
    for p in kids:
        try:
            title = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
        if title.startswith(PREFIX):
            out.append((p.pid, title.split()[0], lambda p=p: _running(p)))
    return out


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _Line:
    """One guarded block; `pending` is the death its watcher reports. The block runs while
    it is `_current`."""

    def __init__(self) -> None:
        self.pending: Optional[str] = None


_current: Optional[_Line] = None


def _handler(signum, frame) -> None:
    global _current
    line = _current
    if line is not None and line.pending:
        reason, line.pending, _current = line.pending, None, None  # (the block's exit may not run)
        raise EngineDied(reason)


@contextlib.contextmanager
def lifeline(processes: Optional[Callable[[], List[Tuple[int, str, Callable[[], bool]]]]] = None,
             poll: Optional[float] = None, grace: Optional[float] = None) -> Iterator[None]:
    """Run the block; `EngineDied` in it once a process `processes()` listed (default:
    `vllm_processes`) has died and `grace` seconds (GRACE) have passed, looking every `poll`
    seconds (POLL); see the module's docstring."""
    global _current
    processes = processes or vllm_processes
    poll = POLL if poll is None else poll
    grace = GRACE if grace is None else grace
    main = threading.main_thread()
    if threading.current_thread() is not main or _current is not None:
        yield
        return
    if signal.getsignal(SIGNAL) is not _handler:
        signal.signal(SIGNAL, _handler)
    line, stop = _Line(), threading.Event()
    seen: Dict[int, Tuple[str, Callable[[], bool]]] = {}

    def look() -> None:
        for pid, title, alive in processes():
            if pid not in seen and alive():  # one already gone belongs to an engine closed
                seen[pid] = (title, alive)

    def watch() -> None:
        dead_since, reason = None, ""
        while not stop.wait(poll):
            look()
            if dead_since is None:
                gone = [(pid, title) for pid, (title, alive) in seen.items() if not alive()]
                if gone:
                    dead_since = time.monotonic()
                    reason = (f"vLLM's process {gone[0][1]} (pid {gone[0][0]}) died while "
                              "the engine was working")
            elif time.monotonic() - dead_since >= grace and _current is line:
                line.pending = reason
                signal.pthread_kill(main.ident, SIGNAL)
                return

    look()  # here, not a poll later: a worker that fails the block's first call dies at once
    _current = line
    thread = threading.Thread(target=watch, name="eagle3x-engine-lifeline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        if _current is line:
            _current = None
        stop.set()
