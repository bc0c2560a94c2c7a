"""Stage `train`: a Lightning Trainer fits the EAGLE-3 draft, then exports it.

Builds what is missing first (prepare, extract, vocab), so it runs on a fresh config.
Checkpoints go to <run dir>/checkpoints (`last.ckpt` always); `train.resume=auto`
continues from there, `train.resume=<path>` from a given checkpoint, loaded with
weights_only=True. The export lands in <run dir>/draft.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from eagle3x import artifacts, layout

log = logging.getLogger("eagle3x")


def draft_shape(cfg: DictConfig, info: Any, draft_vocab: int) -> Dict[str, Any]:
    raw = info.raw
    rope = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return dict(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size,
        intermediate_size=cfg.train.intermediate_size or info.intermediate_size,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads,
        head_dim=int(raw.get("head_dim") or info.hidden_size // info.num_heads),
        draft_vocab_size=draft_vocab, target_vocab_size=info.vocab_size,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)))


def resume_path(cfg: DictConfig, out: Path) -> Optional[str]:
    r = cfg.train.resume
    if r == "none":
        return None
    if r == "auto":
        last = out / "checkpoints" / "last.ckpt"
        if last.exists():
            log.info("resuming from %s", last)
            return str(last)
        return None
    if not Path(r).is_file():
        raise artifacts.ArtifactError(f"train.resume={r}: no such checkpoint file")
    return r


def build_module(cfg: DictConfig, vocab_dir: str) -> Any:
    import torch

    from eagle3x.draft.module import DraftModule
    from eagle3x.stages import vocab
    from eagle3x.stages.extract import Plan

    plan = Plan(cfg)
    v = vocab.load(vocab_dir)
    train_cfg = OmegaConf.to_container(cfg.train, resolve=True)
    return DraftModule(draft_shape(cfg, plan.info, len(v["d2t"])), train_cfg, str(plan.verifier),
                       bool(plan.info.raw.get("tie_word_embeddings", False)), plan.aux_ids,
                       cfg.trainer.max_steps, torch.from_numpy(v["d2t"]),
                       torch.from_numpy(v["t2d"])), plan


def make_trainer(cfg: DictConfig, out: Path, logger: Any) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar

    t = cfg.trainer
    every = max(1, t.max_steps // 10) if t.max_steps > 0 else 500
    callbacks = [ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="step{step:06d}",
                                 auto_insert_metric_name=False,
                                 every_n_train_steps=every, save_last=True, save_top_k=-1)]
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if t.enable_progress_bar and sys.stderr.isatty():
        callbacks.append(RichProgressBar())
    val_every = t.val_check_interval or max(1, t.max_steps // 4 if t.max_steps > 0 else 1000)
    devices: Any = t.devices if not str(t.devices).isdigit() else int(t.devices)
    return L.Trainer(
        accelerator=t.accelerator, devices=devices, strategy=t.strategy, precision=t.precision,
        max_steps=t.max_steps, max_epochs=t.max_epochs if t.max_epochs else -1,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=int(val_every) * t.accumulate_grad_batches,
        check_val_every_n_epoch=None, logger=logger, callbacks=callbacks,
        default_root_dir=str(out), use_distributed_sampler=False,
        enable_progress_bar=t.enable_progress_bar, num_sanity_val_steps=0,
        enable_model_summary=False)


def _mean_tokens_per_batch(dm: Any) -> float:
    """Average real tokens in a training batch (for throughput figures)."""
    reader, idx = dm.train_set.reader, dm.train_set.indices
    lengths = [reader.index[i][2] - reader.index[i][1] for i in idx]
    return sum(lengths) / max(len(lengths), 1) * min(dm.cfg.train.batch_size, len(lengths))


def run(cfg: DictConfig) -> str:
    import lightning as L

    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.draft.export import export
    from eagle3x.stages import extract, prepare, vocab
    from eagle3x.tracking.loggers import make_logger

    prepare.run(cfg)
    hidden = extract.run(cfg)
    vocab_dir = vocab.run(cfg)
    out = layout.run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    module, plan = build_module(cfg, vocab_dir)
    dm = HiddenStateDataModule(cfg, hidden_dir=hidden)
    logger = make_logger(cfg, out)
    trainer = make_trainer(cfg, out, logger)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=resume_path(cfg, out), weights_only=True)
    wall = time.perf_counter() - t0
    if trainer.interrupted:
        raise SystemExit(130)
    draft_dir = export(module.draft, out / "draft", plan.aux_ids,
                       include_embeddings=not cfg.train.freeze_embeddings)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {"stage": "train", "steps": trainer.global_step, "train_seconds": wall,
               "train_tokens_per_step": _mean_tokens_per_batch(dm),
               "train_samples": len(dm.train_set), "val_samples": len(dm.val_set),
               "metrics": metrics, "draft": str(draft_dir), "hidden": hidden, "vocab": vocab_dir}
    if logger and cfg.logger.name.value == "wandb":
        summary["wandb_run_id"] = logger.experiment.id
    artifacts.write_json_atomic(out / "train_summary.json", summary)
    log.info("trained %d steps in %.1fs; val acc_0 %.3f, accept_len %.2f; draft -> %s",
             trainer.global_step, wall, metrics.get("val/acc_0", float("nan")),
             metrics.get("val/accept_len", float("nan")), draft_dir)
    return str(draft_dir)
