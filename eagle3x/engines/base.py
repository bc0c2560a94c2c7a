"""The hidden-state engine protocol, and `open_engine`, which picks and loads one.

Layer convention: aux layer id k is the *output* of decoder layer k (0-based), i.e.
Hugging Face's ``hidden_states[k + 1]`` and vLLM's aux layer id ``k + 1``. The last
hidden state is the final decoder output after the model's final norm: the vector the
verifier's lm_head reads.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, TYPE_CHECKING, Tuple

import torch

if TYPE_CHECKING:
    from eagle3x.config.schema import EngineConfig
    from eagle3x.plan import VerifierRef


class EngineFailed(RuntimeError):
    """An engine (vLLM or transformers) failed while starting or working.

    `engine` names it ("vllm", "hf"), `during` what it was doing ("start", "extract",
    "generate", "serve"); `offset` is where its lines begin in the job's log, which
    `cause()` reads (call it once the engine is shut down: its processes write their
    traceback as they die)."""

    def __init__(self, engine: str, during: str, offset: int, rpc_timeout: Optional[int] = None):
        super().__init__(f"engine {engine} failed during {during}")
        self.engine, self.during, self.offset, self.rpc_timeout = engine, during, offset, rpc_timeout

    def cause(self) -> str:
        from eagle3x import console
        from eagle3x.engines.watch import cause

        return cause(console.log_since(self.offset), self.__cause__, self.rpc_timeout)


@contextlib.contextmanager
def failing_as(engine: str, during: str, offset: int,
               rpc_timeout: Optional[int] = None) -> Iterator[None]:
    """Any error of the engine in the block becomes `EngineFailed` (the original as its
    __cause__); KeyboardInterrupt and SystemExit pass. A vLLM block runs on a `lifeline`:
    were an engine process to die while it waits, the wait ends (`EngineDied`)."""
    from eagle3x.engines.lifeline import lifeline

    try:
        with (lifeline() if engine == "vllm" else contextlib.nullcontext()):
            yield
    except EngineFailed:
        raise
    except Exception as exc:
        raise EngineFailed(engine, during, offset, rpc_timeout) from exc


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


class HiddenStateEngine(Protocol):
    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """For each token-id list: (aux [T, 3H], last [T, H]) on CPU."""

    def close(self) -> None:
        """Free the engine's memory and processes."""


def shutdown_llm(llm: object) -> None:
    """Stop a vllm.LLM's engine processes now (not at garbage collection), freeing their
    memory before the next engine starts; a no-op for None."""
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


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


def open_engine(settings: "EngineConfig", verifier: "VerifierRef", aux_ids: Sequence[int],
                max_seq_len: int, scratch: Path) -> HiddenStateEngine:
    """The engine `settings.name` chooses, loaded with the verifier (slow: minutes on big models).

    `scratch` is a folder the vLLM engine may write temporary files into (the output folder).
    """
    from eagle3x.config.schema import EngineName

    if settings.name is EngineName.hf:
        from eagle3x.engines.hf import HFEngine

        return HFEngine(verifier.path, aux_ids, settings.dtype, settings.device,
                        verifier.trust_remote_code)
    from eagle3x.engines.vllm import VLLMEngine

    return VLLMEngine(verifier.path, aux_ids, verifier.info.num_layers, verifier.rms_norm_eps,
                      max_seq_len, vllm_options(settings, verifier), scratch)
