"""The hidden-state engine protocol, and `open_engine`, which picks and loads one: the
top of `engines/` (the engines it opens import `engines.errors` and `engines.options`,
never this module, so nothing here runs back in a circle).

Layer convention: aux layer id k is the *output* of decoder layer k (0-based), i.e.
Hugging Face's ``hidden_states[k + 1]`` and vLLM's aux layer id ``k + 1``. The last
hidden state is the final decoder output after the model's final norm: the vector the
verifier's lm_head reads.

Torch-free at import (torch appears in annotations only). `EngineFailed`, `failing_as`,
`set_rpc_timeout`, `vllm_options`, `mla_attention` and `shutdown_llm` live in
`engines.errors` / `engines.options`; they are named here too, for callers that import
them from this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Protocol, Sequence, TYPE_CHECKING, Tuple

from eagle3x.engines.errors import EngineFailed, failing_as  # noqa: F401 (named here too)
from eagle3x.engines.options import (mla_attention, set_rpc_timeout,  # noqa: F401
                                     shutdown_llm, vllm_options)

if TYPE_CHECKING:
    import torch

    from eagle3x.config.schema import EngineConfig
    from eagle3x.plan import VerifierRef


class HiddenStateEngine(Protocol):
    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
        """For each token-id list: (aux [T, 3H], last [T, H]) on CPU."""

    def close(self) -> None:
        """Free the engine's memory and processes."""


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
