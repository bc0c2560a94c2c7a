"""Reading a verifier's weights by tensor name, and the numerics both engines and the draft share.

Nothing here loads a model: single tensors come straight out of the safetensors files
(through ``model.safetensors.index.json`` when the checkpoint is sharded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

#: Where the input embedding, output head and final norm live in common checkpoints
#: (plain causal LMs, and multimodal wrappers with the LM under ``model.language_model``).
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight",)
FINAL_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


def read_tensor(verifier: Path, name: str) -> torch.Tensor:
    """One weight of the verifier by tensor name; KeyError naming the folder if absent."""
    from safetensors import safe_open

    verifier = Path(verifier)
    index = verifier / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            files = [json.load(f)["weight_map"].get(name)]
    else:
        files = [p.name for p in sorted(verifier.glob("*.safetensors"))]
    for fname in files:
        if not fname:
            continue
        with safe_open(str(verifier / fname), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(f"{verifier}: no tensor named {name!r} in its safetensors")


def find_tensor(verifier: Path, candidates: Sequence[str]) -> torch.Tensor:
    """The first of `candidates` the checkpoint holds."""
    for name in candidates:
        try:
            return read_tensor(verifier, name)
        except KeyError:
            continue
    raise KeyError(f"{verifier}: none of {list(candidates)} found in its safetensors")


def verifier_head(verifier: Path, tied: bool) -> torch.Tensor:
    """The verifier's output projection [V, H] (the input embedding when tied)."""
    return find_tensor(verifier, HEAD_NAMES + (EMBED_NAMES if tied else ()))


def verifier_logits(hidden: torch.Tensor, head: torch.Tensor, softcap: Optional[float] = None,
                    scale: float = 1.0) -> torch.Tensor:
    """The verifier's float32 logits from its last hidden states: the lm_head `head`
    [V, H] (in its dtype), then what the family applies after it (`VerifierInfo.
    logit_scale`, then `.logit_softcap`)."""
    logits = (hidden.to(head.dtype) @ head.T).float()
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it: normalise in float32, cast back to x's
    dtype, then scale by `weight` (the draft's norms and the vLLM engine's final norm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def torch_dtype(name: str, default: torch.dtype = torch.float32) -> torch.dtype:
    """A dtype setting ("auto", "float32", "float16", "bfloat16") as a torch dtype."""
    return {"auto": default, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]
