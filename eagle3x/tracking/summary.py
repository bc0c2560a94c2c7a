"""summary.json: one file per job saying what it ran, built, reused and measured.

Written into the job's folder (the Hydra run dir, or train.output_dir) after the stages:
the overrides, data size, per-stage wall time, each artifact built or reused, training
tokens, the training's cost (FLOPs per token, tokens/s, share of the peak) and final
per-step accuracies, and the eval acceptance (offline, and live in vLLM
with `eval.live`). `eagle3x.compare` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

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
        # eval.benchmarks: one flat row per prompt set (eagle3x.evaluation.report)
        "benchmarks": _benchmark_rows(evaluation),
        "benchmark_device": (evaluation.get("benchmarks") or {}).get("device"),
        # draft FLOPs per token, tokens/s and the share of the device's peak (stages/train)
        "train_cost": train.get("cost"),
        "stage_seconds": stage_seconds,
        "artifacts": first_status(outcomes),
        "wandb_run_id": train.get("wandb_run_id"),
    }
    artifacts.write_json_atomic(out / "summary.json", summary)
    return out / "summary.json"


def _figures(o: Outcome, out: Path) -> str:
    """The key figures of one stage's outcome, read from what it wrote."""
    try:
        if o.kind in ("prepared", "hidden", "vocab"):
            m = artifacts.read_manifest(o.path)
            if o.kind == "prepared":
                st = m["stats"]
                return f"{st['samples']} samples, {st['tokens']} tokens"
            if o.kind == "vocab":
                return f"{m['stats']['draft_vocab_size']} tokens cover {m['stats']['coverage']:.1%}"
            runs = m.get("runs") or []
            speed = f", {runs[-1]['tokens_per_second']:.0f} tok/s" if runs and o.status == "built" else ""
            return f"{m['samples']} samples{speed}"
        if o.kind == "draft":
            t = _read(out / "train_summary.json")
            metrics = t.get("metrics", {})
            return (f"{t.get('steps')} steps, val acc_0 {metrics.get('val/acc_0', 0):.3f}, "
                    f"accept_len {metrics.get('val/accept_len', 0):.2f}")
        if o.kind == "eval":
            e = _read(out / "eval.json")
            text = (f"accepted length {e['mean_accepted_length']:.3f} offline "
                    f"({e.get('measures', 'data')})")
            live = (e.get("live") or {}).get("served") or {}
            if live.get("mean_accepted_length"):
                text += f", {live['mean_accepted_length']:.3f} in vLLM"
            return text
    except (artifacts.ArtifactError, KeyError, TypeError, ValueError):
        pass
    return ""


def table(plan: RunPlan, outcomes: Sequence[Outcome], stage_seconds: Dict[str, float]) -> str:
    """One line per stage: built or reused, time, key figures, where its output is."""
    names = list(stage_seconds)
    rows = [(name, o.status, f"{stage_seconds[name]:.1f}s", _figures(o, plan.run_dir), str(o.path))
            for name, o in zip(names, outcomes)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
                     for r in rows)


def _benchmark_rows(evaluation: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    from eagle3x.evaluation.report import benchmark_rows

    bench = evaluation.get("benchmarks")
    return benchmark_rows(bench) if bench else None
