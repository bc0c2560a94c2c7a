"""The reference engine: transformers with output_hidden_states, batched with padding."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

import torch

from eagle3x.weights import torch_dtype


class HFEngine:
    def __init__(self, verifier: Path, aux_ids: Sequence[int], dtype: str = "auto",
                 device: str = "auto", trust_remote_code: bool = False):
        from transformers import AutoModel

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.aux_ids = list(aux_ids)
        self.model = AutoModel.from_pretrained(
            str(verifier), dtype=torch_dtype(dtype), use_safetensors=True,
            trust_remote_code=trust_remote_code).to(self.device).eval()

    @torch.inference_mode()
    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
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
