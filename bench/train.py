"""Draft-training throughput and peak memory (CPU, and GPU when one is visible).

    python bench/train.py [--steps 60] [overrides ...]

Builds prepared data, hidden states and vocab for the config (reused when present),
then times `--steps` training steps of a real Lightning Trainer after a short warmup,
counting the tokens of each batch. Prints tokens/s, steps/s and peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import lightning as L
import torch


class Meter(L.Callback):
    def __init__(self, warmup: int):
        self.warmup, self.tokens, self.t0, self.steps = warmup, 0, None, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.warmup and self.t0 is None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()
        if self.t0 is not None:
            self.tokens += int(batch["lengths"].sum())
            self.steps += 1

    def on_train_end(self, trainer, module):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    known, extra = p.parse_known_args()
    from eagle3x.config.compose import load_config, typed
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.pipeline import BY_NAME, run_stages, start
    from eagle3x.stages.train import build_module

    total = known.steps + known.warmup
    settings = typed(load_config(["stage=train", "engine=hf", "logger=none",
                                  f"trainer.max_steps={total}",
                                  "trainer.enable_progress_bar=false", *extra]))
    plan = start(settings)
    # What the train stage reads, built (or reused) by the stages the graph runs before it.
    run_stages(plan, settings, [BY_NAME[n] for n in BY_NAME["train"].before])
    module = build_module(plan, settings.train, total)
    meter = Meter(known.warmup)
    t = settings.trainer
    trainer = L.Trainer(accelerator=t.accelerator, devices=1, precision=t.precision,
                        max_steps=total, logger=False, callbacks=[meter], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=HiddenStateDataModule.from_plan(plan, settings.train,
                                                                   settings.extract))
    res = {"device": "cuda" if torch.cuda.is_available() else "cpu", "steps": meter.steps,
           "tokens_per_s": meter.tokens / meter.seconds, "steps_per_s": meter.steps / meter.seconds,
           "batch_size": settings.train.batch_size, "ttt_steps": settings.train.ttt_steps,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        res["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    print(f"{res['device']}: {res['tokens_per_s']:.0f} tokens/s, {res['steps_per_s']:.2f} steps/s "
          f"(batch {res['batch_size']}, ttt {res['ttt_steps']}), peak RSS {res['peak_rss_mb']:.0f} MB"
          + (f", peak GPU {res['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in res else ""))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
