"""The hidden-state engine protocol and the pieces both engines share.

Layer convention: aux layer id k is the *output* of decoder layer k (0-based), i.e.
Hugging Face's ``hidden_states[k + 1]`` and vLLM's aux layer id ``k + 1``. The last
hidden state is the final decoder output after the model's final norm: the vector the
verifier's lm_head reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Protocol, Sequence, Tuple

import torch


class HiddenStateEngine(Protocol):
    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """For each token-id list: (aux [T, 3H], last [T, H]) on CPU."""

    def close(self) -> None:
        """Free the engine's memory and processes."""


def read_tensor(verifier: Path, name: str) -> torch.Tensor:
    """One weight of the verifier by tensor name, from its safetensors (no model load)."""
    from safetensors import safe_open

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
    for name in candidates:
        try:
            return read_tensor(verifier, name)
        except KeyError:
            continue
    raise KeyError(f"{verifier}: none of {list(candidates)} found in its safetensors")


FINAL_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm in float32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def torch_dtype(name: str, default: torch.dtype = torch.float32) -> torch.dtype:
    return {"auto": default, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]
