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

from tests.helpers import Cli

# vLLM's CPU build sizes its KV cache from engine.gpu_memory_utilization: GiBs to allocate and
# a warm-up pass at every engine start (20-100 s here). The tests' tiny verifiers need
# little; 1 GiB given explicitly also skips the warm-up of eager engines
# (vllm/v1/worker/cpu_worker.py, `_should_warm_up_model`). Engines started by the tests'
# subprocesses inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


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


@pytest.fixture(autouse=True)
def _quick_tests_start_nothing(request, monkeypatch):
    """In a test not marked slow, starting a process or an engine fails the test."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    from eagle3x.engines import watch

    def refuse(what: str):
        def stop(*args, **kwargs):
            # pytest's Failed is a BaseException: no `except Exception` of the code under
            # test swallows it
            pytest.fail(f"{request.node.nodeid} {what}: {MARK_IT}", pytrace=False)
        return stop

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("starts a process"))
    monkeypatch.setattr(watch.StartWatch, "__enter__", refuse("starts an engine"))
    yield


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
