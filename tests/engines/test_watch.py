"""Reading an engine through its log (eagle3x.engines.watch): every line the start phases
and the death causes look for is one the installed vLLM logs (read from its source, so a
vLLM that changes a message fails here); the causes that cannot happen on this machine (a
CUDA error, CUDA out of memory) from torch's own messages. A real start and real deaths:
tests/reliability/test_engine_failures.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3x.engines.watch import VLLM_PHASES, cause

#: (file under vllm/, the text of a message it logs, the message as logged)
VLLM_LINES = [
    ("v1/engine/core.py", "Initializing a V1 LLM engine (v%s) with config: %s",
     "Initializing a V1 LLM engine (v0.32.0) with config: model='/m'"),
    ("v1/worker/cpu_model_runner.py", "Starting to load model %s...",
     "Starting to load model /m..."),
    ("v1/worker/gpu_model_runner.py", "Starting to load model %s...",
     "Starting to load model /m..."),
    ("v1/worker/cpu_model_runner.py", "Warming up model for the compilation...",
     "Warming up model for the compilation..."),
    ("compilation/backends.py", "Dynamo bytecode transform time: %.2f s",
     "[backbone] Dynamo bytecode transform time: 4.21 s"),
    ("compilation/backends.py", "Directly load the compiled graph(s) for compile",
     "[backbone] Directly load the compiled graph(s) for compile range (1, 8192) from the cache"),
    ("compilation/decorators.py", "%sDirectly load AOT compilation from path %s",
     "[backbone] Directly load AOT compilation from path /root/.cache/vllm/torch_compile_cache"),
    ("v1/worker/gpu_model_runner.py", "Capturing CUDA graphs ({}, {})",
     "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%"),
    ("v1/core/kv_cache_utils.py", "%s KV cache size: %s tokens, ",
     "CPU KV cache size: 1,063,859 tokens, Maximum concurrency"),
    ("v1/engine/core.py", "init engine (profile, create kv cache, warmup model) took ",
     "init engine (profile, create kv cache, warmup model) took 47.24 s"),
]


def vllm_source(rel: str) -> str:
    vllm = pytest.importorskip("vllm")
    return (Path(vllm.__file__).parent / rel).read_text()


@pytest.mark.parametrize("rel,text,logged", VLLM_LINES)
def test_each_start_phase_is_read_from_a_line_vllm_logs(rel, text, logged):
    assert text in vllm_source(rel), (rel, text)
    phases = [phase for pattern, phase in VLLM_PHASES if re.search(pattern, logged)]
    assert len(phases) == 1, (logged, phases)


def test_the_compile_phases_say_how_to_skip_them():
    for pattern, phase in VLLM_PHASES:
        if "compiling" in phase or "CUDA graphs" in phase:
            assert "engine.enforce_eager=true skips it" in phase


def test_each_death_vllm_reports_is_named():
    src = vllm_source("v1/executor/multiproc_executor.py")
    assert 'f"RPC call to {method} timed out."' in src
    assert '"Worker proc %s died unexpectedly (exit code: %s), "' in src
    timeout = cause("(EngineCore pid=1) ERROR [core.py:1512] TimeoutError: RPC call to "
                    "execute_model timed out.", rpc_timeout=300)
    assert timeout.startswith("vLLM's worker did not answer `execute_model` within "
                              "engine.rpc_timeout=300s (RPC timeout")
    killed = cause("ERROR [multiproc_executor.py:315] Worker proc VllmWorker-3 died unexpectedly "
                   "(exit code: -9), shutting down executor.")
    assert killed == ("vLLM's worker process VllmWorker-3 died (killed by SIGKILL, as the "
                      "kernel's out-of-memory killer does)")
    assert "exit code 1" in cause("Worker proc VllmWorker-0 died unexpectedly (exit code: 1), ")


def test_gpu_failures_are_named_from_torchs_messages():
    """Cannot happen here (no GPU): torch's own wording (c10/cuda/CUDACachingAllocator.cpp,
    c10/cuda/CUDAException.h) as vLLM's worker logs it in its traceback."""
    oom = cause("(Worker pid=7) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to "
                "allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB")
    assert oom.startswith("out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate")
    err = cause("(Worker pid=7) ERROR RuntimeError: CUDA error: an illegal memory access was "
                "encountered\nWorker proc VllmWorker-0 died unexpectedly (exit code: 1)")
    assert err == "CUDA error: an illegal memory access was encountered"


def test_without_a_known_line_the_last_error_or_the_exception_speaks():
    assert cause("INFO fine\n(EngineCore pid=1) ERROR [core.py:9] ValueError: bad shape\n") == \
        "the engine logged: (EngineCore pid=1) ERROR [core.py:9] ValueError: bad shape"
    try:
        raise KeyError("hidden_states_path")
    except KeyError as exc:
        assert cause("", exc) == "KeyError: 'hidden_states_path'"
