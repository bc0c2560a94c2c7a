"""Stage `eval`: offline greedy acceptance of a draft on held-out samples.

From every trained position of the validation split the draft proposes `eval.depth`
tokens in a chain, feeding back its own proposals; a proposal is accepted while each
equals the verifier's greedy token there. Reports the mean accepted length (accepted
drafts + the verifier's own token) and the acceptance rate at each depth. The verifier's
greedy tokens come from the stored last hidden states, along the data's own continuation:
where the data leaves the verifier's greedy path this is an estimate of live decoding.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EvalConfig, ExtractConfig, TrainConfig
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")


def evaluate(draft: Any, head: Any, loader: Any, depth: int, max_samples: int) -> Dict[str, Any]:
    import torch

    from eagle3x.draft.ttt import chain_acceptance

    counts = torch.zeros(depth + 1, dtype=torch.long)  # positions with exactly j accepted
    seen = 0
    draft.eval()
    for batch in loader:
        res = chain_acceptance(draft, batch, head, depth)
        acc = res["accepted"][res["valid"]]
        counts += torch.bincount(acc, minlength=depth + 1)[: depth + 1]
        seen += int(batch["lengths"].numel())
        if seen >= max_samples:
            break
    total = int(counts.sum())
    reached = [int(counts[j:].sum()) for j in range(depth + 1)]  # accepted >= j
    rates = [reached[j + 1] / reached[j] if reached[j] else 0.0 for j in range(depth)]
    mean = float((counts * torch.arange(depth + 1)).sum()) / max(total, 1)
    return {"positions": total, "samples": seen, "depth": depth,
            "mean_accepted_length": 1.0 + mean, "acceptance_rate_per_depth": rates}


def run(plan: RunPlan, eval: EvalConfig, train: TrainConfig, extract: ExtractConfig) -> Outcome:
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.draft.save import load
    from eagle3x.weights import EMBED_NAMES, find_tensor, verifier_head

    out = plan.run_dir
    draft_dir = Path(eval.draft) if eval.draft else out / "draft"
    if not (draft_dir / "config.json").exists():
        raise artifacts.ArtifactError(f"{draft_dir}: no exported draft; train first or set eval.draft")
    vpath = plan.verifier.path
    draft = load(draft_dir, find_tensor(vpath, EMBED_NAMES).float())
    head = verifier_head(vpath, plan.verifier.tied_head).float()
    dm = HiddenStateDataModule.from_plan(plan, train, extract)
    dm.setup()
    report = evaluate(draft, head, dm.val_dataloader(), eval.depth, eval.max_samples)
    report["draft"] = str(draft_dir)
    out.mkdir(parents=True, exist_ok=True)
    artifacts.write_json_atomic(out / "eval.json", report)
    wandb = sys.modules.get("wandb")  # the train stage of this run opened it, if any
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update({"eval/mean_accepted_length": report["mean_accepted_length"],
                                  **{f"eval/accept_rate_{j}": r for j, r in
                                     enumerate(report["acceptance_rate_per_depth"])}})
    log.info("eval: mean accepted length %.3f over %d positions; acceptance per depth %s",
             report["mean_accepted_length"], report["positions"],
             " ".join(f"{r:.2f}" for r in report["acceptance_rate_per_depth"]))
    return Outcome("eval", "wrote", out / "eval.json")
