"""The LightningModule: an EAGLE-3 draft trained with training-time test."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional

import lightning as L
import torch

from eagle3x.draft.model import DraftShape, Eagle3Draft
from eagle3x.draft.ttt import expected_accept_length, ttt_step_metrics
from eagle3x.weights import EMBED_NAMES, FINAL_NORM_NAMES, find_tensor, verifier_head


class DraftModule(L.LightningModule):
    """Holds the draft, the frozen verifier head (not checkpointed) and the TTT objective.

    Hyperparameters are plain json-like values so checkpoints load with weights_only=True.
    """

    def __init__(self, *, shape: Dict[str, Any], train: Dict[str, Any], verifier: str,
                 tied_head: bool, aux_layer_ids: list, max_steps: int,
                 d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None):
        super().__init__()
        # logger=False: the run logger already carries the full resolved Hydra config.
        self.save_hyperparameters(ignore=["d2t", "t2d"], logger=False)
        s = DraftShape(**shape)
        if d2t is None:  # restored from a checkpoint: buffers come with the state dict
            d2t = torch.zeros(s.draft_vocab_size, dtype=torch.long)
            t2d = torch.zeros(s.target_vocab_size, dtype=torch.bool)
        self.draft = Eagle3Draft(s, d2t, t2d)
        path = Path(verifier)
        head = verifier_head(path, tied_head)
        self.register_buffer("head", head.float(), persistent=False)
        with torch.no_grad():
            self.draft.embed_tokens.weight.copy_(find_tensor(path, EMBED_NAMES).float())
            targets = torch.arange(s.draft_vocab_size) + self.draft.d2t
            self.draft.lm_head.weight.copy_(head.float()[targets])
            self.draft.norm.weight.copy_(find_tensor(path, FINAL_NORM_NAMES).float())
        self.draft.embed_tokens.weight.requires_grad_(not train["freeze_embeddings"])
        self._val: Dict[str, list] = {}

    def _metrics(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        t = self.hparams.train
        return ttt_step_metrics(self.draft, batch, self.head, t["ttt_steps"], t["step_weight"])

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        m = self._metrics(batch)
        steps = self.hparams.train["ttt_steps"]
        logs = {"train/loss": m["loss"].detach(), "train/accept_len": m["accept_len"]}
        for k in range(steps):
            logs[f"train/acc_{k}"] = m[f"acc_{k}"]
            logs[f"train/loss_{k}"] = m[f"loss_{k}"]
        self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False,
                      batch_size=int(batch["lengths"].numel()))
        self.log("acc_0", m["acc_0"], prog_bar=True, logger=False)
        return m["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        m = self._metrics(batch)
        steps = self.hparams.train["ttt_steps"]
        for k in range(steps):
            n = m[f"count_{k}"].float()
            self._val.setdefault(f"hits_{k}", []).append(m[f"acc_{k}"] * n)
            self._val.setdefault(f"n_{k}", []).append(n)
            self._val.setdefault(f"loss_{k}", []).append(m[f"loss_{k}"] * n)

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        steps = self.hparams.train["ttt_steps"]
        accs, logs = [], {}
        for k in range(steps):
            n = torch.stack(self._val[f"n_{k}"]).sum().clamp(min=1)
            acc = torch.stack(self._val[f"hits_{k}"]).sum() / n
            accs.append(acc)
            logs[f"val/acc_{k}"] = acc
            logs[f"val/loss_{k}"] = torch.stack(self._val[f"loss_{k}"]).sum() / n
        logs["val/accept_len"] = expected_accept_length(accs)
        self.log_dict(logs, prog_bar=False)
        self.log("val_acc_0", accs[0], prog_bar=True, logger=False)

    def configure_optimizers(self) -> Any:
        t = self.hparams.train
        params = [p for p in self.draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"],
                                betas=(0.9, 0.95))
        warmup, total = t["warmup_steps"], max(self.hparams.max_steps, 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / max(warmup, 1)
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
