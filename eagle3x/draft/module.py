"""The LightningModule: an EAGLE-3 draft trained with training-time test."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, Optional

import lightning as L
import torch

from eagle3x.draft.model import DraftShape, Eagle3Draft
from eagle3x.draft.ttt import expected_accept_length, feature_noise, ttt_step_metrics
from eagle3x.weights import EMBED_NAMES, FINAL_NORM_NAMES, find_tensor, verifier_head


class DraftModule(L.LightningModule):
    """Holds the draft, the frozen verifier head (not checkpointed) and the TTT objective.

    Hyperparameters are plain json-like values so checkpoints load with weights_only=True.
    """

    def __init__(self, *, shape: Dict[str, Any], train: Dict[str, Any], verifier: str,
                 tied_head: bool, aux_layer_ids: list, max_steps: int,
                 max_seconds: Optional[float] = None,
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
        self.draft.lm_head.weight.requires_grad_(not train.get("freeze_lm_head", False))
        impl = train.get("attention", "auto")
        self.draft.set_layer_options(block=train.get("attention_block", 512),
                                     impl=getattr(impl, "value", impl),
                                     checkpoint_mlp_tokens=train.get("checkpoint_mlp_tokens", 16384))
        self._val: Dict[str, list] = {}
        self._clock: Optional[float] = None  # training's start (the time-bound schedule)

    def on_train_start(self) -> None:
        self._clock = time.perf_counter()

    def time_done(self) -> float:
        """The fraction of `max_seconds` (trainer.max_time) spent since training started
        (0 without a time bound or before training)."""
        seconds = self.hparams.get("max_seconds")
        if not seconds or self._clock is None:
            return 0.0
        return (time.perf_counter() - self._clock) / seconds

    def _metrics(self, batch: Dict[str, torch.Tensor], denominators: Optional[torch.Tensor] = None,
                 accuracy: bool = True) -> Dict[str, torch.Tensor]:
        t = self.hparams.train
        return ttt_step_metrics(self.draft, batch, self.head, t["ttt_steps"], t["step_weight"],
                                chunk=t.get("loss_chunk", 2048),
                                softcap=self.hparams.get("logit_softcap"),
                                scale=self.hparams.get("logit_scale", 1.0),
                                denominators=denominators, accuracy=accuracy,
                                hard=t.get("loss", "soft") == "hard",
                                teacher_topk=t.get("teacher_topk"))

    def _logging_now(self) -> bool:
        """Whether Lightning writes this training step's metrics (every
        trainer.log_every_n_steps): accuracy, which needs the verifier's greedy token over
        its full vocabulary, and the gradient norm are computed only then."""
        if self._trainer is None:
            return True
        connector = getattr(self.trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True))

    def _world(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def _sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(x, reduce_op="sum") if self._world() > 1 else x

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        steps, weight = self.hparams.train["ttt_steps"], self.hparams.train["step_weight"]
        log_now = self._logging_now()
        counts = batch.get("counts")
        if counts is None:
            from eagle3x.draft.ttt import trained_positions

            batch["select"] = trained_positions(batch["loss_mask"], batch["lengths"], steps,
                                                batch.get("doc_end"))
            counts = torch.tensor([len(x) for x in batch["select"]], device=self.device)
        counts = counts[:steps].float()
        noise = self.hparams.train.get("feature_noise", 0.0)
        if noise:
            batch = dict(batch, aux_hidden=feature_noise(
                batch["aux_hidden"], len(self.hparams.aux_layer_ids), noise))
        # The loss is the global batch's token mean whatever the number of processes: each
        # step's cross-entropy over the positions of every rank's batch. DDP averages the
        # gradients over ranks, so each rank divides by the global count / world.
        world = self._world()
        total = self._sum_over_ranks(counts) if world > 1 else counts
        m = self._metrics(batch, denominators=total.clamp(min=1) / world, accuracy=log_now)
        if log_now:  # read only when Lightning writes them: no device sync at other steps
            ce = torch.stack([m[f"ce_{k}"] for k in range(steps)])
            hits = torch.stack([m[f"acc_{k}"] * counts[k] for k in range(steps)])
            stats = self._sum_over_ranks(torch.stack([ce, hits])) if world > 1 else torch.stack([ce, hits])
            n = total.clamp(min=1)
            w = torch.tensor([weight ** k for k in range(steps)], device=ce.device)
            accs = list(stats[1] / n)
            logs = {"train/loss": (w * stats[0] / n).sum(),
                    "train/accept_len": expected_accept_length(accs)}
            for k in range(steps):
                logs[f"train/acc_{k}"] = accs[k]
                logs[f"train/loss_{k}"] = stats[0][k] / n[k]
            self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False,
                          batch_size=int(batch["lengths"].numel()))
            self.log("acc_0", accs[0], prog_bar=True, logger=False)
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
        self._val.setdefault("choice", []).append(m["verifier_choice"].float())

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
        choice = (torch.stack(self._val["choice"]).sum() if self._val
                  else torch.zeros((), device=self.device))
        if sharded:  # each rank saw its share of the held-out set; every rank reduces
            sums = self._sum_over_ranks(sums)
            choice = self._sum_over_ranks(choice)
        hits, n, loss = sums[0], sums[1].clamp(min=1), sums[2]
        accs, logs = [], {}
        for k in range(steps):
            accs.append(hits[k] / n[k])
            logs[f"val/acc_{k}"] = accs[k]
            logs[f"val/loss_{k}"] = loss[k] / n[k]
        logs["val/accept_len"] = expected_accept_length(accs)
        # the data, not the draft: how much of the held-out text the verifier would write
        logs["val/verifier_choice"] = choice / n[0]
        self.log_dict(logs, prog_bar=False)
        self.log("val_acc_0", accs[0], prog_bar=True, logger=False)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """The gradient norm the optimizer steps with (all ranks' gradients averaged,
        before clipping): `train/grad_norm`."""
        if not self._logging_now():
            return
        grads = [p.grad for p in self.draft.parameters() if p.grad is not None]
        if grads:  # on the device (Lightning's grad_norm reads every norm to the host)
            total = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.float()) for g in grads]))
            self.log("train/grad_norm", total, on_step=True, on_epoch=False)

    def _batch_unit(self) -> tuple:
        """What a micro-batch is counted in: ("samples", "train.batch_size") or, with
        token-sized batches, ("tokens", "train.max_tokens")."""
        if self.hparams.train.get("max_tokens"):
            return "tokens", "train.max_tokens"
        return "samples", "train.batch_size"

    def _global_batch(self) -> int:
        t = self.trainer
        per = self.hparams.train[self._batch_unit()[1].split(".")[1]]
        return per * t.world_size * t.accumulate_grad_batches

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
        checkpoint["eagle3x"] = {"global_batch": self._global_batch(),
                                 "batch_unit": self._batch_unit()[0], "frozen": frozen,
                                 "threads": torch.get_num_threads()}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        from eagle3x.artifacts import ArtifactError

        saved_info = checkpoint.get("eagle3x") or {}
        saved = saved_info.get("global_batch")
        unit, key = self._batch_unit()
        saved_unit = saved_info.get("batch_unit", "samples")
        if saved is not None and self._trainer is not None and (
                saved != self._global_batch() or saved_unit != unit):
            t = self.trainer

            raise ArtifactError(
                f"{self._ckpt_path()}: the checkpoint was trained with a global batch of "
                f"{saved} {saved_unit} per step; this run's is {self._global_batch()} {unit} "
                f"({key}={self.hparams.train[key.split('.')[1]]} x {t.world_size} processes x "
                f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}). Resuming "
                f"continues the same sample stream only with the same global batch: set "
                + (f"{key} to {saved} / (processes x accumulate_grad_batches)."
                   if saved_unit == unit else
                   f"train.max_tokens as the checkpoint's run did ({saved_unit}-sized batches)."))
        threads = saved_info.get("threads")
        if threads and threads != torch.get_num_threads():
            import logging

            logging.getLogger("eagle3x").info(
                "note: the checkpoint's run computed with %d threads, this one with %d: "
                "sums split over threads round differently, so the resumed weights match an "
                "uninterrupted run to float rounding (~1e-7 relative), not bit for bit",
                threads, torch.get_num_threads())
        # Frozen parameters left out of the checkpoint come back from the verifier, which
        # must still hold what the run started from.
        recorded = saved_info.get("frozen") or {}
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
        named = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        # the fused CUDA kernel where every parameter is on a GPU (one launch per step)
        fused = bool(params) and all(p.is_cuda for p in params)
        if t.get("optimizer", "adamw") == "muon":
            opt = muon_and_adamw(named, t, fused)
        else:
            opt = adamw(params, t, fused)
        total = max(self.hparams.max_steps, 1)
        timed = bool(self.hparams.get("max_seconds"))
        # Without a time bound the warmup is 1% of max_steps (at least 1 step). With one
        # (trainer.max_time) and no train.warmup_steps: the first 1% of the run, the
        # further of steps and time, the first step at 1% of the rate.
        by_fraction = timed and t.get("warmup_steps") is None
        warmup = t["warmup_steps"] if t.get("warmup_steps") is not None else max(1, round(total / 100))
        schedule, floor = t.get("schedule", "cosine"), t.get("min_lr_ratio", 0.1)

        def factor(step: int) -> float:
            if by_fraction:
                done = max(step / total, self.time_done())
                if done < 0.01:
                    return max(done / 0.01, 0.01)
                progress = min((done - 0.01) / 0.99, 1.0)
            elif step < warmup:
                return (step + 1) / max(warmup, 1)
            else:
                progress = min(max((step - warmup) / max(total - warmup, 1), self.time_done()),
                               1.0)
            if schedule == "constant":
                return 1.0
            if schedule == "linear":
                return floor + (1 - floor) * (1 - progress)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Optimizers(torch.optim.Optimizer):
    """Several optimizers stepped as one (Lightning's automatic optimization takes one):
    their param groups (shared, so a scheduler sets every group's lr), one closure call
    per step, state dicts side by side."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers
        self.defaults: Dict[str, Any] = {}
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for o, s in zip(self.optimizers, state_dict["optimizers"]):
            o.load_state_dict(s)

    def __repr__(self) -> str:
        return "Optimizers(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"


def muon_and_adamw(named: list, t: Dict[str, Any], fused: bool) -> Optimizers:
    """Muon (torch.optim.Muon's, its iterations in train.muon_dtype: draft/muon.py) for
    the trained 2-D matrices of the decoder layers and fc, AdamW for the rest: lm_head,
    embeddings, norms (speculators' split, speculators/train/optimizers.py
    split_named_params_for_muon). Muon's update is scaled
    to AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`, speculators' default): one learning
    rate means the same step size in both. torch's own default ("original") makes an
    576x1728 matrix's step ~8x smaller at the same lr."""
    matrices = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1
                and not n.startswith(("lm_head", "embed_tokens"))]
    ids = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in ids]
    from eagle3x.draft.muon import Muon

    opts = [Muon(matrices, ns_dtype=t.get("muon_dtype", "auto"), lr=t.get("muon_lr") or t["lr"],
                 weight_decay=t["weight_decay"], adjust_lr_fn="match_rms_adamw")]
    if rest:
        opts.append(adamw(rest, t, fused))
    return Optimizers(opts)


def adamw(params: list, t: Dict[str, Any], fused: bool) -> torch.optim.AdamW:
    """AdamW at train.lr with betas (0.9, 0.95); the fused CUDA kernel when `fused`."""
    return torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"],
                             betas=(0.9, 0.95), fused=fused or None)
