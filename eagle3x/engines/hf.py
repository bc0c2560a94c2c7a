"""The reference engine: transformers with output_hidden_states, batched with padding."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

import torch

from eagle3x.weights import torch_dtype


class HFEngine:
    """Errors while extracting (out of memory, a CUDA error) come out as `EngineFailed`;
    a verifier that does not load stays a `VerifierLoadError`."""

    def __init__(self, verifier: Path, aux_ids: Sequence[int], dtype: str = "auto",
                 device: str = "auto", trust_remote_code: bool = False):
        from eagle3x.engines.watch import HF_LOADING, StartWatch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.aux_ids = list(aux_ids)
        with StartWatch("hf", phases=(), first=HF_LOADING) as watch:
            self.model = load_base_model(Path(verifier), torch_dtype(dtype),
                                         trust_remote_code).to(self.device).eval()
        self.offset, self.started = watch.offset, ""

    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        from eagle3x.engines.errors import failing_as

        with failing_as("hf", "extract", self.offset):
            return self._extract(batch)

    @torch.inference_mode()
    def _extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        lengths = [len(x) for x in batch]
        width = max(lengths)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        aux = torch.cat([hs[k + 1] for k in self.aux_ids], dim=-1).cpu()
        last = out.last_hidden_state.cpu()
        return [(aux[i, :n], last[i, :n]) for i, n in enumerate(lengths)]

    def close(self) -> None:
        del self.model


class VerifierLoadError(RuntimeError):
    """transformers left parameters of the verifier at their random initialisation."""


def load_base_model(verifier: Path, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
    """The verifier's decoder stack (no head), every parameter read from its checkpoint.
    The dtype applies to what is computed; a compressed-tensors checkpoint's int4 weights
    are dequantized on load (transformers' CompressedTensorsHfQuantizer).

    A quantized checkpoint is loaded through its own architecture class, then its base
    model taken: compressed-tensors' `ignore` list names modules as the full model names
    them (``model.layers.0.mlp.gate_proj``), and loading the base class alone (AutoModel,
    whose modules are ``layers.0...``) would match none of them, expect int4 tensors for
    the float layers and initialise those at random. Any parameter transformers reports
    missing from the checkpoint is refused (its features would be noise)."""
    import json

    import transformers
    from transformers import AutoModel

    with open(verifier / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    cls, extra = AutoModel, {}
    quant = config.get("quantization_config") or {}
    if quant:
        named = [getattr(transformers, a, None) for a in config.get("architectures") or ()]
        cls = next((c for c in named if c is not None and hasattr(c, "from_pretrained")),
                   AutoModel)
    if quant.get("quant_method") == "compressed-tensors":
        # int4 weights dequantized once on load (its compressed forward has no CPU path)
        extra["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model, info = cls.from_pretrained(str(verifier), dtype=dtype, use_safetensors=True,
                                      trust_remote_code=trust_remote_code,
                                      output_loading_info=True, **extra)
    missing = sorted(info.get("missing_keys") or ())
    if cls is not AutoModel:
        missing = [k for k in missing if not k.startswith("lm_head.")]
        base = getattr(model, "model", None)
        if base is None:
            raise VerifierLoadError(f"{verifier}: {cls.__name__} has no base model (.model)")
        model = base
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise VerifierLoadError(
            f"{verifier}: transformers found no weights for {len(missing)} parameters of "
            f"{cls.__name__} ({shown}); they would be random, and so would the hidden states.")
    return model
