"""Stage `train`: a Lightning Trainer fits the EAGLE-3 draft, then exports it.

The pipeline runs prepare, extract and vocab first (each reuses a finished artifact), so
`stage=train` works on a fresh config. Checkpoints go to <run dir>/checkpoints: one every
max_steps/10 steps, the newest `train.keep_checkpoints` of them kept, and `last.ckpt`
always; they leave the frozen verifier weights out (``DraftModule.on_save_checkpoint``).
`train.resume` (read by ``plan.Resume``) continues from the run folder's last checkpoint
or a given one, loaded with weights_only=True. The export lands in <run dir>/draft.

Off a terminal a progress line replaces the bar; SIGTERM/SIGINT end training at the end of
the step under way with a checkpoint (``failures.Stopped``); on several processes a rank
that fails stops the others (``eagle3x.draft.callbacks``, ``distributed.RankWatch``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from os import environ
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from eagle3x import artifacts, console, distributed
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import (DraftConfig, EngineConfig, ExportConfig, ExtractConfig,
                                   HiddenConfig,
                                   HiddenSource, LoggerConfig, LoggerName, TrainConfig,
                                   TrainerConfig)
from eagle3x.draft.shape import draft_shape
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")


def build_module(plan: RunPlan, train: TrainConfig, max_steps: int,
                 draft: Optional[Dict[str, Any]] = None, load_init: bool = True,
                 max_seconds: Optional[float] = None) -> Any:
    """The Lightning module for the plan's verifier and vocabulary (vocab must exist);
    `draft`: the architecture options (DraftConfig.options(), or a checkpoint's). With
    `plan.init` (draft.init) the architecture is the published draft's and, with
    `load_init`, its weights are loaded: every one, lm_head rows re-mapped by token id
    when the vocab artifact re-mapped them (its `rows`; new rows keep the verifier's
    lm_head rows DraftModule starts from). `max_seconds`: trainer.max_time (the schedule
    runs on time too)."""
    import torch

    from eagle3x.draft.module import DraftModule
    from eagle3x.stages import vocab

    v = vocab.load(plan.vocab.folder)
    if plan.init is not None:
        from eagle3x import published

        p = published.read(plan.init.folder)
        shape = {**p.shape, "draft_vocab_size": len(v["d2t"])}
    else:
        shape = draft_shape(plan.verifier, len(v["d2t"]), train.intermediate_size, draft)
    module = DraftModule(
        shape=shape,
        train=plain(dataclasses.asdict(train)), verifier=str(plan.verifier.path),
        tied_head=plan.verifier.tied_head, aux_layer_ids=list(plan.aux_layer_ids),
        max_steps=max_steps, max_seconds=max_seconds, d2t=torch.from_numpy(v["d2t"]),
        t2d=torch.from_numpy(v["t2d"]),
        logit_softcap=plan.verifier.info.logit_softcap,
        logit_scale=plan.verifier.info.logit_scale)
    if plan.init is not None and load_init:
        from eagle3x.draft.save import load_into, published_weights

        remapped = "rows" in v
        state = published_weights(
            p, *((torch.from_numpy(v["d2t"]), torch.from_numpy(v["t2d"]),
                  torch.from_numpy(v["rows"]), module.draft.lm_head.weight.detach().clone())
                 if remapped else ()))
        with torch.no_grad():
            load_into(module.draft, state, f"draft.init={plan.init.folder}",
                      embeddings=not train.freeze_embeddings)
        log.info("draft.init: starting from the %s draft at %s (%d layer%s, %s vocabulary of "
                 "%d tokens); optimizer and schedule start fresh", p.layout, plan.init.folder,
                 p.shape["num_layers"], "s" if p.shape["num_layers"] > 1 else "",
                 "a re-mapped" if remapped else "its own", len(v["d2t"]))
    return module


def plain(settings: dict) -> dict:
    """Settings as json values (enums by value): a checkpoint's hyperparameters load with
    weights_only=True only when they hold nothing else."""
    from enum import Enum

    return {k: v.value if isinstance(v, Enum) else v for k, v in settings.items()}


def throughput_callback(skip: int = 5) -> Any:
    """A Lightning callback measuring the loop's steady training speed: real tokens (the
    batch's host-side `n_tokens`) per second of wall time from the end of optimizer step
    `skip` to the end of training, less the time spent in validation; the device is
    synchronised only at those boundaries. `result()` -> dict for the train summary."""
    from lightning.pytorch.callbacks import Callback

    class Throughput(Callback):
        def __init__(self) -> None:
            self.t0: Optional[float] = None
            self.t1 = self.v0 = None
            self.paused, self.tokens, self.batches = 0.0, 0, 0

        @staticmethod
        def _now(module: Any) -> float:
            if module.device.type == "cuda":
                import torch

                torch.cuda.synchronize(module.device)
            return time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self.t0 is None:
                if trainer.global_step >= skip:
                    self.t0 = self._now(module)
                return
            self.tokens += int(batch.get("n_tokens", 0)) if isinstance(batch, dict) else 0
            self.batches += 1

        def on_validation_start(self, trainer, module) -> None:
            if self.t0 is not None:
                self.v0 = self._now(module)

        def on_validation_end(self, trainer, module) -> None:
            if self.v0 is not None:
                self.paused += self._now(module) - self.v0
                self.v0 = None

        def on_train_end(self, trainer, module) -> None:
            if self.t0 is not None:
                self.t1 = self._now(module)

        def result(self) -> dict:
            if self.t0 is None or self.t1 is None or not self.batches:
                return {}
            seconds = self.t1 - self.t0 - self.paused
            return {"tokens_per_second": self.tokens / max(seconds, 1e-9),
                    "seconds": round(seconds, 3), "tokens": self.tokens,
                    "micro_batches": self.batches, "after_step": skip,
                    "validation_seconds": round(self.paused, 3), "per": "process"}

    return Throughput()


def training_cost(module: Any, dm: Any, train: TrainConfig,
                  throughput: Dict[str, Any]) -> Dict[str, Any]:
    """The train summary's cost: draft FLOPs per token (eagle3x.draft.cost: the matmuls of
    forward + backward for this shape, TTT steps and the training samples' causal context),
    the loop's tokens/s, the FLOP/s that makes, and its share of the device's peak (a GPU's
    tabled dense bf16 peak; on a CPU a float32 matmul rate measured here)."""
    from eagle3x.draft.cost import causal_context, device_peak, flops_per_token

    shape = dict(module.hparams.shape)
    context = causal_context(dm.train_lengths(), shape.get("sliding_window"))
    fraction, head_from = 1.0, "online hidden states: every position, an upper bound"
    if dm.features is None:  # the lm_head sees trained positions only: their share, from
        n = min(len(dm.train_set), 64)  # the first 64 training samples' loss masks
        masks = [dm.train_set[i]["loss_mask"] for i in range(n)]
        total = sum(len(m) for m in masks)
        fraction = float(sum(int(m[1:].sum()) for m in masks)) / max(total, 1) if n else 1.0
        head_from = f"the loss masks of {n} training samples"
    parts = flops_per_token(shape, train.ttt_steps, context, fraction,
                            lm_head_trained=not train.freeze_lm_head)
    cost: Dict[str, Any] = {
        "flops_per_token": parts["train"], "ttt_steps": train.ttt_steps,
        "forward_flops_per_token": {k: v for k, v in parts.items() if k != "train"},
        "context": round(context, 2), "head_fraction": fraction, "head_fraction_from": head_from,
        "counted": "matmuls; forward + backward: fc 2x, lm_head 3x trained / 2x frozen, "
                   "teacher 1x, the rest 3x (eagle3x.draft.cost)"}
    tps = throughput.get("tokens_per_second")
    if tps:
        peak, what = device_peak(module.device)
        cost.update(tokens_per_second=tps, achieved_flops=tps * parts["train"],
                    peak_flops=peak, peak=what,
                    fraction_of_peak=tps * parts["train"] / peak if peak else None)
    return cost


def make_trainer(t: TrainerConfig, out: Path, logger: Any, keep: int = 3,
                 progress_seconds: float = 30.0, extra: Optional[list] = None) -> Any:
    """The Lightning Trainer for `trainer.*`: step checkpoints (the newest `keep` of them,
    and last.ckpt), the rich bar on a terminal, progress lines every `progress_seconds`
    (on the console off a terminal, in the job's log file always), `extra` callbacks."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar

    from eagle3x.draft.callbacks import ProgressLines

    class StepsBar(RichProgressBar):
        """Lightning's rich bar, described by the run's bound: "train 150 steps" for a
        step-bounded run (Lightning's own reads "Epoch 0/-2" there)."""

        def _get_train_description(self, current_epoch: int) -> str:
            if self.trainer.max_steps and self.trainer.max_steps > 0:
                return f"train {self.trainer.max_steps} steps"
            return super()._get_train_description(current_epoch)

    every = max(1, t.max_steps // 10) if t.max_steps > 0 else 500
    # The newest `keep` step checkpoints: "step" (the global step) is always among
    # ModelCheckpoint's monitor candidates.
    callbacks = [ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="step{step:06d}",
                                 auto_insert_metric_name=False, monitor="step", mode="max",
                                 every_n_train_steps=every, save_last=True, save_top_k=keep)]
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    bar = t.enable_progress_bar and console.is_terminal()
    if bar:
        callbacks.append(StepsBar(console_kwargs={"file": console.stream()}))
    callbacks.append(ProgressLines(progress_seconds, to_console=not bar))
    callbacks += extra or []
    val_every = t.val_check_interval or max(1, t.max_steps // 4 if t.max_steps > 0 else 1000)
    devices: Any = t.devices if not str(t.devices).isdigit() else int(t.devices)
    return L.Trainer(
        accelerator=t.accelerator, devices=devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=t.precision,
        max_steps=t.max_steps, max_epochs=t.max_epochs if t.max_epochs else -1,
        max_time=None if t.max_time is None else timedelta(seconds=t.max_time),
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=int(val_every) * t.accumulate_grad_batches,
        check_val_every_n_epoch=None, logger=logger, callbacks=callbacks,
        default_root_dir=str(out), use_distributed_sampler=False,
        # off a terminal Lightning's own bar would write into the job log ("Epoch 0/-2")
        enable_progress_bar=bar, num_sanity_val_steps=0,
        enable_model_summary=False)


def precheck(trainer: TrainerConfig) -> Optional[str]:
    """What Lightning says of these Trainer settings when it builds a Trainer (no data, no
    model: about a second), or None. The pipeline runs it before the stages that come
    first, so a combination Lightning refuses never waits behind an extraction."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            make_trainer(trainer, Path(tmp), None)
    except Exception as exc:  # Lightning's MisconfigurationException, ValueError, ...
        return f"Lightning refuses them: {exc}"
    return None


#: Below this share of held-out tokens that are the verifier's own greedy choice, a run
#: on the data's own replies is told to regenerate them (bench/RESULTS.md, issue 36: on
#: SmolLM2 the bundled replies, 65% its choice, served 1.30 where its own replies, 99.7%,
#: served 2.08 in the same training time).
OWN_TEXT_SHARE = 0.9


def verifier_choice_line(share: Optional[float], advise: bool) -> Optional[Tuple[int, str]]:
    """(logging level, line) on the data trained: `share` of the held-out trained tokens
    the verifier would have written itself (`val/verifier_choice`). A served draft reads
    only the verifier's tokens, so text it would not write teaches contexts it never
    meets: below OWN_TEXT_SHARE, with `advise`, the line is a warning naming
    data.responses=regenerated. `advise`: the data's own replies and a real verifier (the
    regenerated replies, sampled at a temperature, fall below 1.0 by design; the embedded
    tiny verifier is a toy fitted to the bundled replies, 84.5% on them, whose own text
    would teach nothing), else the share is only reported. None without a validation."""
    if share is None or share != share:
        return None
    head = (f"data: {100 * share:.1f}% of the held-out trained tokens are the verifier's own "
            f"greedy choice after the text before them")
    if not advise or share >= OWN_TEXT_SHARE:
        return logging.INFO, head
    return logging.WARNING, (
        head + "; a served draft reads only the verifier's own tokens, and one trained on "
        "text the verifier would not write serves less (SmolLM2, equal training time: 1.30 "
        "tokens a round on the bundled replies, 65% its choice, 2.08 on its own replies): "
        "data.responses=regenerated trains on the verifier's own replies "
        "(docs/guides/regenerate.md)")


def pin_threads() -> int:
    """Fix this process's intra-op thread count at what torch chose, for the whole run.

    torch.set_num_threads also turns MKL's dynamic threading off (ATen's
    ParallelOpenMP.cpp: mkl_set_dynamic(false)); left on (MKL's default, until something
    calls set_num_threads), MKL may run a matrix product on fewer threads than asked, and
    Intel lists that as what breaks run-to-run reproducibility. The count itself is part
    of the arithmetic: a reduction split over 2 threads rounds differently from 1
    (measured: a resume on 1 thread of a 2-thread run ends 3.3e-7 relative from the
    uninterrupted run, bit-equal on 2), so checkpoints record it
    (``DraftModule.on_save_checkpoint``) and a resume on another count says so."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(n)
    return n


def samples_made(features: Any, world: int) -> list:
    """How many samples each training process had its engine or servers make (rank
    order): each rank makes only its own batches, so they add up to the samples trained
    and validated on, none twice."""
    mine = int(features.stats()["made"])
    if world > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            every: list = [None] * world
            dist.all_gather_object(every, mine)
            return [int(x) for x in every]
    return [mine]


def run(plan: RunPlan, train: TrainConfig, trainer: TrainerConfig, logger: LoggerConfig,
        extract: ExtractConfig, engine: Optional[EngineConfig] = None,
        hidden: HiddenConfig = HiddenConfig(), draft: DraftConfig = DraftConfig(),
        export: ExportConfig = ExportConfig()) -> Outcome:
    import lightning as L

    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.draft.callbacks import Preemption, RankFailures
    from eagle3x.draft.save import write_formats
    from eagle3x.tracking.loggers import make_logger

    out = plan.run_dir
    out.mkdir(parents=True, exist_ok=True)
    if distributed.worker_argv() is None and environ.get("RANK", "0") in ("", "0"):
        distributed.clear_board(out)
    # SIGTERM from here on checkpoints and stops (before fit: stops before the first step)
    preemption = Preemption(out / "checkpoints" / "last.ckpt")
    preemption.install()
    ranks = RankFailures(out)
    # a time-bound run (trainer.max_time) may take few steps: its speed after the first
    speed = throughput_callback(skip=1 if trainer.max_time else
                                min(5, max(trainer.max_steps // 4, 0))
                                if trainer.max_steps > 0 else 5)
    pin_threads()
    L.seed_everything(train.seed, workers=True, verbose=False)
    ckpt = plan.resume.training_checkpoint(out)
    # a checkpoint to resume from holds the weights: draft.init only shapes the module
    module = build_module(plan, train, trainer.max_steps, draft.options(), load_init=ckpt is None,
                          max_seconds=trainer.max_time)
    online = hidden.source is not HiddenSource.offline
    dm = HiddenStateDataModule.from_plan(plan, train, extract, engine if online else None,
                                         hidden if online else None)
    exp_logger = make_logger(logger, out, plan.config)
    fitter = make_trainer(trainer, out, exp_logger, keep=train.keep_checkpoints,
                          progress_seconds=train.progress_seconds,
                          extra=[preemption, ranks, speed])
    if ckpt is not None and plan.resume.mode == "auto":
        log.info("resuming from %s", ckpt)
    t0 = time.perf_counter()
    made = None
    try:
        with distributed.fit_scope():  # (the process group lives until its end)
            try:
                fitter.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None,
                           weights_only=True)
            finally:
                dm.close()
            if dm.features is not None and not fitter.interrupted:
                made = samples_made(dm.features, fitter.world_size)
    finally:
        ranks.stop()
        preemption.restore()
    wall = time.perf_counter() - t0
    if fitter.interrupted:
        raise SystemExit(130)
    if not fitter.is_global_zero:  # rank 0 writes the export and the summaries
        log.info("rank %d of %d trained %d steps", fitter.global_rank, fitter.world_size,
                 fitter.global_step)
        return Outcome("draft", "rank", out / "draft")
    draft_dir = write_formats(module.draft, plan.run_dir, [f.value for f in export.format],
                              list(plan.aux_layer_ids),
                              include_embeddings=not train.freeze_embeddings,
                              verifier_architectures=plan.verifier.info.architectures,
                              verifier=str(plan.verifier.path))
    metrics = {k: float(v) for k, v in fitter.callback_metrics.items()}
    summary = {"stage": "train", "steps": fitter.global_step, "train_seconds": wall,
               "train_tokens_per_step": dm.mean_tokens_per_batch(),
               "train_samples": len(dm.train_set), "val_samples": len(dm.val_set),
               "metrics": metrics, "draft": str(draft_dir),
               "hidden": hidden.source.value if online else str(plan.hidden.folder),
               "vocab": str(plan.vocab.folder)}
    if dm.features is not None:  # how long the trainer waited for the online engine
        st = dm.features.stats()
        summary.update(hidden_wait_seconds=round(st["wait_s"], 3),
                       hidden_wait_fraction=round(st["wait_s"] / max(wall, 1e-9), 4),
                       hidden_engine_seconds=round(st["compute_s"], 3),
                       hidden_engine_start_seconds=round(st["engine_load_s"], 3),
                       hidden_samples_made=made)
        if exp_logger and logger.name is LoggerName.wandb:
            exp_logger.experiment.summary.update(
                {"hidden/wait_fraction": summary["hidden_wait_fraction"],
                 "hidden/wait_seconds": summary["hidden_wait_seconds"]})
        log.info("online hidden states: the trainer waited %.1fs of %.1fs (%.0f%%) for the "
                 "engine (%.1fs computing, %.1fs to start)", st["wait_s"], wall,
                 100 * st["wait_s"] / max(wall, 1e-9), st["compute_s"], st["engine_load_s"])
    throughput = speed.result()
    if throughput:
        summary["throughput"] = throughput
    summary["cost"] = training_cost(module, dm, train, throughput or {})
    if "val/verifier_choice" in metrics:
        summary["verifier_choice"] = metrics["val/verifier_choice"]
    if exp_logger and logger.name is LoggerName.wandb:
        summary["wandb_run_id"] = exp_logger.experiment.id
    artifacts.write_json_atomic(out / "train_summary.json", summary)
    log.info("trained %d steps in %.1fs; val acc_0 %.3f, accept_len %.2f; draft -> %s",
             fitter.global_step, wall, metrics.get("val/acc_0", float("nan")),
             metrics.get("val/accept_len", float("nan")), draft_dir)
    from eagle3x.draft.cost import cost_line

    log.info("%s", cost_line(summary["cost"]))
    regenerated = plan.config.get("data", {}).get("responses") == "regenerated"
    line = verifier_choice_line(summary.get("verifier_choice"),
                                advise=not regenerated and not plan.verifier.tiny)
    if line is not None:
        log.log(*line)
    return Outcome("draft", "built", draft_dir)
