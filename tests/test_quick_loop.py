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
