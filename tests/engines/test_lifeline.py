"""eagle3x.engines.lifeline: a main thread waiting on a future nobody will complete (what
vLLM's client does for a utility call whose engine died) is woken once a watched process
dies; a process that lives, a block that ended and another thread are left alone. The
watched processes are real child processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from eagle3x.engines.errors import EngineFailed, failing_as
from eagle3x.engines.lifeline import EngineDied, lifeline, vllm_processes


def child(title: str = "VLLM::EngineCore") -> subprocess.Popen:
    """A sleeping child process titled `title` (its argv[0], where vLLM's setproctitle
    writes its title)."""
    return subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 600"])


def watching(proc: subprocess.Popen, title: str = "VLLM::EngineCore"):
    def processes():
        return [(proc.pid, title, lambda: proc.poll() is None)]
    return processes


@pytest.mark.slow
def test_a_wait_on_a_dead_process_ends_with_its_name_after_the_grace():
    proc = child()
    try:
        threading.Timer(0.3, proc.kill).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match=rf"VLLM::EngineCore \(pid {proc.pid}\) died"):
            with lifeline(watching(proc), poll=0.05, grace=0.5):
                Future().result(timeout=20)  # never completed: vLLM's call_utility
        took = time.monotonic() - t0
        assert 0.8 <= took < 5, took  # the kill (0.3 s) + the grace (0.5 s), not before
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_living_process_and_a_finished_block_are_left_alone():
    proc = child()
    try:
        with lifeline(watching(proc), poll=0.05, grace=0.1):
            time.sleep(0.5)  # the process lives: the block ends on its own
        proc.kill()
        proc.wait()
        time.sleep(0.5)  # the watcher is gone with its block: nothing arrives late
        # a signal sent after the block, as a watcher racing the block's end would, is ignored
        import signal

        from eagle3x.engines import lifeline as module

        signal.pthread_kill(threading.main_thread().ident, module.SIGNAL)
        time.sleep(0.1)
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_process_already_gone_when_the_block_starts_is_an_engine_closed_before():
    old = child()
    old.kill()
    time.sleep(0.2)  # a zombie, not reaped: what a closing engine can leave for a moment
    try:
        with lifeline(watching(old), poll=0.05, grace=0.1):
            time.sleep(0.5)
    finally:
        old.wait()


@pytest.mark.slow
def test_a_death_before_the_first_poll_is_caught():
    """The processes are listed as the block starts: a worker that dies on the block's
    first call, before the watcher's first look, is seen."""
    proc = child()
    try:
        time.sleep(0.2)
        with pytest.raises(EngineDied):
            with lifeline(watching(proc), poll=0.5, grace=0.2):
                proc.kill()
                Future().result(timeout=20)
    finally:
        proc.wait()


@pytest.mark.slow
def test_vllms_own_error_within_the_grace_comes_through_unchanged():
    proc = child()
    try:
        with pytest.raises(ValueError, match="vLLM raised first"):
            with lifeline(watching(proc), poll=0.05, grace=5.0):
                proc.kill()
                time.sleep(0.5)  # the death is seen; the grace has not passed
                raise ValueError("vLLM raised first")
    finally:
        proc.wait()


@pytest.mark.slow
def test_outside_the_main_thread_the_block_runs_unguarded():
    proc = child()
    got = []

    def work():
        with lifeline(watching(proc), poll=0.05, grace=0.1):
            proc.kill()
            time.sleep(0.8)  # the death and the grace pass; nothing is raised anywhere
        got.append("ended")

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join(10)
        time.sleep(0.3)
        assert got == ["ended"]
    finally:
        proc.wait()


@pytest.mark.slow
def test_a_vllm_block_of_failing_as_has_a_lifeline_and_its_cause_names_the_process(monkeypatch):
    """failing_as("vllm", ...) guards with the default watcher (VLLM::-titled processes
    under this one); the stage's cause line names the dead process."""
    from eagle3x.engines import lifeline as module

    monkeypatch.setattr(module, "POLL", 0.05)
    monkeypatch.setattr(module, "GRACE", 0.3)
    proc = child("VLLM::Worker_TP0")
    time.sleep(0.2)  # bash has become the titled process
    threading.Timer(0.3, proc.kill).start()
    try:
        with pytest.raises(EngineFailed) as info:
            with failing_as("vllm", "serve", 0):
                Future().result(timeout=20)
        assert isinstance(info.value.__cause__, EngineDied)
        assert info.value.cause() == "vLLM's process VLLM::Worker_TP0 died"
        with failing_as("hf", "extract", 0):  # transformers runs in this process: no watcher
            assert module._current is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_default_watcher_lists_vllm_titled_descendants_and_sees_them_die():
    plain, titled = child("sleeper"), child("VLLM::EngineCore")
    try:
        time.sleep(0.2)
        found = {pid: (title, alive) for pid, title, alive in vllm_processes()}
        assert plain.pid not in found and found[titled.pid][0] == "VLLM::EngineCore"
        assert found[titled.pid][1]()
        titled.kill()
        time.sleep(0.2)  # a zombie until reaped: dead all the same
        assert not found[titled.pid][1]()
    finally:
        for p in (plain, titled):
            p.kill()
            p.wait()
