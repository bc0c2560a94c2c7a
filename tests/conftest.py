"""Shared fixtures: a per-test artifact store, one tiny verifier for the session, CLI runners.

Helpers (records, stage_output, in-process plans) live in tests/helpers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import Cli

# vLLM's CPU build sizes its KV cache from engine.gpu_memory_utilization: GiBs to allocate and
# a warm-up pass at every engine start (20-100 s here). The tests' tiny verifiers need
# little; 1 GiB given explicitly also skips the warm-up of eager engines
# (vllm/v1/worker/cpu_worker.py, `_should_warm_up_model`). Engines started by the tests'
# subprocesses inherit it.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


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
