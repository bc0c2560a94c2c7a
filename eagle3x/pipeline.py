"""Run a stage (or all of them in order) for a validated config."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Dict, Optional

from omegaconf import DictConfig

log = logging.getLogger("eagle3x")

#: Stage name -> "module:function"; imported only when the stage runs.
STAGES: Dict[str, str] = {
    "prepare": "eagle3x.stages.prepare:run",
    "extract": "eagle3x.stages.extract:run",
    "vocab": "eagle3x.stages.vocab:run",
    "train": "eagle3x.stages.train:run",
    "eval": "eagle3x.stages.evaluate:run",
    "export": "eagle3x.stages.export:run",
}
ORDER_ALL = ("prepare", "extract", "vocab", "train", "eval")


def _load(stage: str) -> Callable[[DictConfig], str]:
    import importlib

    module, func = STAGES[stage].split(":")
    return getattr(importlib.import_module(module), func)


def run_one(stage: str, cfg: DictConfig, seconds: Optional[Dict[str, float]] = None) -> str:
    t0 = time.perf_counter()
    out = _load(stage)(cfg)
    took = time.perf_counter() - t0
    if seconds is not None:
        seconds[stage] = round(took, 2)
    log.info("stage %s done in %.1fs -> %s", stage, took, out)
    return out


def run(cfg: DictConfig) -> Optional[str]:
    """Run cfg.stage; known errors end the process with a one-line message and status 1."""
    from eagle3x.artifacts import ArtifactError
    from eagle3x.data.conversations import DataError

    from eagle3x.stages.common import EVENTS

    EVENTS.clear()  # Hydra's basic launcher runs every sweep job in this one process
    stage = cfg.stage.value
    seconds: Dict[str, float] = {}
    try:
        if stage == "all":
            out = None
            for s in ORDER_ALL:
                out = run_one(s, cfg, seconds)
        else:
            out = run_one(stage, cfg, seconds)
        if stage in ("all", "train", "eval"):
            from eagle3x.tracking import summary

            log.info("summary -> %s", summary.write(cfg, seconds))
        return out
    except (DataError, ArtifactError) as exc:
        log.error("%s", exc)
        sys.stderr.write(f"eagle3x: {exc}\n")
        sys.exit(1)
    finally:
        _finish_wandb()


def _finish_wandb() -> None:
    """Close a W&B run the stages opened, so offline runs are whole for `wandb sync`."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
