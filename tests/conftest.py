"""Shared fixtures: a per-test artifact store, one tiny verifier for the session, a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent


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


class Cli:
    """Runs `python -m eagle3x` as a user would, in the test's folder and environment."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def __call__(self, *args: str, env: Optional[Dict[str, str]] = None,
                 timeout: float = 900) -> subprocess.CompletedProcess:
        full_env = dict(os.environ, **(env or {}))
        return subprocess.run([sys.executable, "-m", "eagle3x", *args], cwd=self.cwd,
                              env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli(store) -> Cli:
    return Cli(store.parent)


def write_jsonl(path: Path, records: List[object]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def messages_record(*turns) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def sharegpt_record(*turns) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in turns]}


def stage_output(result: subprocess.CompletedProcess, stage: str) -> Path:
    """The artifact path a finished stage logged (`stage X done in ... -> PATH`)."""
    for line in (result.stdout + result.stderr).splitlines():
        if f"stage {stage} done in" in line:
            return Path(line.split("-> ", 1)[1].strip())
    raise AssertionError(f"stage {stage} did not finish:\n{result.stdout}\n{result.stderr}")
