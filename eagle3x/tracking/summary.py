"""summary.json: one file per job saying what it ran, built, reused and measured.

Written into the job's folder (the Hydra run dir, or train.output_dir) after the stages:
the overrides, data size, per-stage wall time, each artifact built or reused, training
tokens and final per-step accuracies, and the eval acceptance (offline, and live in vLLM
with `eval.live`). `eagle3x.compare` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Sequence

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.plan import RunPlan
from eagle3x.tracking.loggers import overrides


def _read(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def first_status(outcomes: Sequence[Outcome]) -> Dict[str, Dict[str, str]]:
    """Per artifact kind, whether this job built it or found it (its first encounter)."""
    seen: Dict[str, Dict[str, str]] = {}
    for o in outcomes:
        if o.kind in ("prepared", "hidden", "vocab"):
            seen.setdefault(o.kind, {"status": o.status, "path": str(o.path)})
    return seen


def write(plan: RunPlan, outcomes: Sequence[Outcome], stage_seconds: Dict[str, float]) -> Path:
    out = plan.run_dir
    out.mkdir(parents=True, exist_ok=True)
    train = _read(out / "train_summary.json")
    evaluation = _read(out / "eval.json")
    live = evaluation.get("live") or {}
    metrics = train.get("metrics", {})
    summary = {
        "overrides": overrides(),
        "stage": plan.stage.value,
        "num_samples": plan.split.num_samples,
        "train_samples": train.get("train_samples"),
        "train_tokens": int(train.get("train_tokens_per_step", 0) * train.get("steps", 0)) or None,
        "steps": train.get("steps"),
        "acc": {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("val/acc_")},
        "val_accept_len": metrics.get("val/accept_len"),
        "eval_accepted_length": evaluation.get("mean_accepted_length"),
        "eval_acceptance_per_depth": evaluation.get("acceptance_rate_per_depth"),
        # eval.live: vLLM's own figure, the exact offline replay of it, and draft parity
        "live_accepted_length": live.get("served", {}).get("mean_accepted_length"),
        "live_acceptance_per_depth": live.get("served", {}).get("acceptance_rate_per_depth"),
        "greedy_accepted_length": live.get("greedy_offline", {}).get("mean_accepted_length"),
        "parity_max_rel_error": live.get("parity_max_rel_error"),
        "stage_seconds": stage_seconds,
        "artifacts": first_status(outcomes),
        "wandb_run_id": train.get("wandb_run_id"),
    }
    artifacts.write_json_atomic(out / "summary.json", summary)
    return out / "summary.json"
