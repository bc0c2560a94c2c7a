"""What the engines are started with: `engine.*` as vLLM takes it (`vllm_options`,
`set_rpc_timeout`, `mla_attention`), and `shutdown_llm`, which stops a vllm.LLM's
processes now.

Torch-free at import (vLLM is imported inside `mla_attention` alone): the factory
(`engines.base.open_engine`), the engines, generation and the serve stage share these.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3x.config.schema import EngineConfig
    from eagle3x.plan import VerifierRef


def set_rpc_timeout(settings: Dict[str, Any]) -> Optional[int]:
    """`engine.rpc_timeout` as vLLM reads it: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, the
    seconds its engine process waits for a worker's answer to execute_model /
    sample_tokens before it declares the engine dead ("RPC call to execute_model timed
    out"; vllm/v1/executor/multiproc_executor.py, read at each call from vllm/envs.py,
    default 300). Set before the engine processes start, which inherit it."""
    timeout = settings.get("rpc_timeout")
    if timeout:
        os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(int(timeout))
    return timeout


def shutdown_llm(llm: object) -> None:
    """Stop a vllm.LLM's engine processes now (not at garbage collection), freeing their
    memory before the next engine starts; a no-op for None. An engine that already died
    has nothing left to stop: what its shutdown raises then is dropped."""
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # a dead engine: its processes are gone or going
            pass


def vllm_options(settings: "EngineConfig", verifier: "VerifierRef") -> Dict[str, Any]:
    """The `engine.*` settings vLLM takes, plus the verifier's trust_remote_code."""
    import dataclasses

    options = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("name", "device")}
    # (rpc_timeout is not an argument of vllm.LLM: set_rpc_timeout applies it)
    options["trust_remote_code"] = verifier.trust_remote_code
    options["mla"] = bool(verifier.info.raw.get("kv_lora_rank"))  # multi-head latent attention
    return options


def mla_attention(settings: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM's attention backend for an MLA verifier (DeepSeek-V2/V3, Kimi-K2) on its CPU
    build, as an argument of vllm.LLM: where the CPU has AMX tiles vLLM picks AMX_MLA
    (vllm/platforms/cpu.py, CpuPlatform.get_attn_backend_cls), which runs bfloat16 alone
    (vllm/v1/attention/backends/mla/amx_mla.py: `supported_dtypes`; its
    `process_weights_after_loading` fails on float32 weights: "expect weight to be
    bfloat16, float16, ..."). In any other dtype the reference CPU_MLA backend, which
    takes any dtype, is asked for by name: what vLLM picks itself without AMX. Empty on
    GPUs, for other verifiers and for bfloat16 (vLLM's `auto` on a CPU)."""
    from eagle3x.families import AMX_MLA_DTYPES

    if not settings.get("mla") or str(settings.get("dtype")) in AMX_MLA_DTYPES:
        return {}
    from vllm.platforms import current_platform

    return {"attention_backend": "CPU_MLA"} if current_platform.is_cpu() else {}
