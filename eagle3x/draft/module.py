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
                 d2t: Optional[torch.Tensor] = None, t2d: Optional[torch.Tensor] = None,
                 logit_softcap: Optional[float] = None, logit_scale: float = 1.0):
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
        self.draft.midlayer.self_attn.block = train.get("attention_block", 512)
        self._val: Dict[str, list] = {}

    def _metrics(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        t = self.hparams.train
        return ttt_step_metrics(self.draft, batch, self.head, t["ttt_steps"], t["step_weight"],
                                chunk=t.get("loss_chunk", 2048),
                                softcap=self.hparams.get("logit_softcap"),
                                scale=self.hparams.get("logit_scale", 1.0))

    def _world(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def _sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(x, reduce_op="sum") if self._world() > 1 else x

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        m = self._metrics(batch)
        steps, weight = self.hparams.train["ttt_steps"], self.hparams.train["step_weight"]
        # Sums over every rank's batch (one process: this batch), so the loss each step
        # reports and trains on is the global batch's whatever the number of processes.
        ce = torch.stack([m[f"ce_{k}"] for k in range(steps)])
        stats = self._sum_over_ranks(torch.stack([
            ce.detach(), torch.stack([m[f"count_{k}"].float() for k in range(steps)]),
            torch.stack([m[f"acc_{k}"] * m[f"count_{k}"] for k in range(steps)])]))
        n = stats[1].clamp(min=1)
        if self._world() > 1:
            # DDP averages gradients over ranks: scaling by world makes that average the
            # gradient of the global token mean, as one process with the whole batch has.
            w = torch.tensor([weight ** k for k in range(steps)], device=ce.device)
            loss = (w * ce / n).sum() * self._world()
            accs = list(stats[2] / n)
            logs = {"train/loss": (w * stats[0] / n).sum()}
        else:
            loss, accs = m["loss"], [m[f"acc_{k}"] for k in range(steps)]
            logs = {"train/loss": m["loss"].detach()}
        logs["train/accept_len"] = expected_accept_length(accs)
        for k in range(steps):
            logs[f"train/acc_{k}"] = accs[k]
            logs[f"train/loss_{k}"] = stats[0][k] / n[k]
        self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False,
                      batch_size=int(batch["lengths"].numel()))
        self.log("acc_0", accs[0], prog_bar=True, logger=False)
        return loss

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
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        sharded = dm is not None and getattr(dm, "val_sharded", lambda: False)()
        if not self._val and not sharded:
            return
        steps = self.hparams.train["ttt_steps"]
        sums = torch.stack([torch.stack([torch.stack(self._val[f"{key}_{k}"]).sum()
                                         if self._val else torch.zeros((), device=self.device)
                                         for k in range(steps)])
                            for key in ("hits", "n", "loss")])
        if sharded:  # each rank saw its share of the held-out set; every rank reduces
            sums = self._sum_over_ranks(sums)
        hits, n, loss = sums[0], sums[1].clamp(min=1), sums[2]
        accs, logs = [], {}
        for k in range(steps):
            accs.append(hits[k] / n[k])
            logs[f"val/acc_{k}"] = accs[k]
            logs[f"val/loss_{k}"] = loss[k] / n[k]
        logs["val/accept_len"] = expected_accept_length(accs)
        self.log_dict(logs, prog_bar=False)
        self.log("val_acc_0", accs[0], prog_bar=True, logger=False)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """The gradient norm the optimizer steps with (all ranks' gradients averaged,
        before clipping): `train/grad_norm`."""
        from lightning.pytorch.utilities import grad_norm

        norms = grad_norm(self.draft, norm_type=2)
        if norms:
            self.log("train/grad_norm", norms["grad_2.0_norm_total"], on_step=True,
                     on_epoch=False)

    def _global_batch(self) -> int:
        t = self.trainer
        return self.hparams.train["batch_size"] * t.world_size * t.accumulate_grad_batches

    def _ckpt_path(self) -> str:
        return str(getattr(self.trainer, "ckpt_path", None) or "the checkpoint")

    def _frozen(self) -> Dict[str, str]:
        """Parameters training does not change (the frozen embedding: verifier weights),
        by name, with a digest of their values (computed once: they do not change)."""
        if getattr(self, "_frozen_digests", None) is None:
            import hashlib

            digests = {}
            for name, p in self.named_parameters():
                if not p.requires_grad:
                    data = p.detach().cpu().contiguous().view(torch.uint8).numpy()
                    digests[name] = hashlib.sha256(data).hexdigest()
            self._frozen_digests = digests
        return self._frozen_digests

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """The checkpoint holds what training changes: frozen parameters (the embedding,
        a verifier weight: 49152 x 576 floats for a 135M verifier) are left out and
        reloaded from the verifier (`__init__`); their digest is kept to check that."""
        frozen = self._frozen()
        state = checkpoint.get("state_dict", {})
        for name in frozen:
            state.pop(name, None)
        checkpoint["eagle3x"] = {"global_batch": self._global_batch(), "frozen": frozen,
                                 "threads": torch.get_num_threads()}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        from eagle3x.artifacts import ArtifactError

        saved = (checkpoint.get("eagle3x") or {}).get("global_batch")
        if saved is not None and self._trainer is not None and saved != self._global_batch():
            t = self.trainer

            raise ArtifactError(
                f"{self._ckpt_path()}: the checkpoint was trained with a global batch of "
                f"{saved} samples per step; this run's is {self._global_batch()} (train.batch_size="
                f"{self.hparams.train['batch_size']} x {t.world_size} processes x "
                f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}). Resuming "
                f"continues the same sample stream only with the same global batch: set "
                f"train.batch_size to {saved} / (processes x accumulate_grad_batches).")
        threads = (checkpoint.get("eagle3x") or {}).get("threads")
        if threads and threads != torch.get_num_threads():
            import logging

            logging.getLogger("eagle3x").info(
                "note: the checkpoint's run computed with %d threads, this one with %d: "
                "sums split over threads round differently, so the resumed weights match an "
                "uninterrupted run to float rounding (~1e-7 relative), not bit for bit",
                threads, torch.get_num_threads())
        # Frozen parameters left out of the checkpoint come back from the verifier, which
        # must still hold what the run started from.
        recorded = (checkpoint.get("eagle3x") or {}).get("frozen") or {}
        state = checkpoint.setdefault("state_dict", {})
        mine = dict(self.named_parameters())
        for name, digest in recorded.items():
            if name in state or name not in mine:
                continue
            if self._frozen().get(name) != digest:
                raise ArtifactError(
                    f"{self._ckpt_path()}: {name} is left out of the checkpoint and read "
                    f"from the verifier ({self.hparams.verifier}), whose weights changed "
                    "since the checkpoint was written; resume with the verifier it was "
                    "trained with.")
            state[name] = mine[name].detach()

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
