"""Stage `eval`: greedy acceptance of a draft on held-out samples, offline and (optionally) live.

Offline, from every trained position of the validation split the draft proposes
`eval.depth` tokens in a chain, feeding back its own proposals; a proposal is accepted
while each equals the verifier's greedy token there. Reports the mean accepted length
(accepted drafts + the verifier's own token) and the acceptance rate at each depth. The
verifier's greedy tokens come from the stored last hidden states, along the data's own
continuation: where the data leaves the verifier's greedy path this is an estimate.

With `eval.live=true` the draft is also served by vLLM on the held-out prompts (``live``):
vLLM's own counters; the offline estimate that is exact for greedy decoding (features
extracted along vLLM's greedy continuation, rounds replayed as vLLM runs them); and the
parity of vLLM's draft with the trained one on the first prompt. Written to eval.json
under "live"; the figures also go to summary.json and W&B.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import (EngineConfig, EvalConfig, ExtractConfig, HiddenConfig,
                                   HiddenSource, TrainConfig)
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


def held_out_prompts(plan: RunPlan, count: int) -> List[List[int]]:
    """The prompt of each held-out sample (its tokens before the first trained token: the
    chat-templated turns up to the assistant's header), the first `count` that have one."""
    from eagle3x.data import prepared
    from eagle3x.draft.live import first_trained

    data = prepared.load(plan.prepared.folder)
    off, ids, mask = data["offsets"], data["input_ids"], data["loss_mask"]
    prompts: List[List[int]] = []
    for i in range(min(plan.split.holdout, data["n"])):
        f = first_trained(mask[off[i]:off[i + 1]])
        if f is not None and f >= 2:
            prompts.append([int(x) for x in ids[off[i]:off[i] + f]])
        if len(prompts) == count:
            break
    return prompts


def live(plan: RunPlan, settings: EvalConfig, extract: ExtractConfig, engine: EngineConfig,
         draft_dir: Path, draft: Any, head: Any) -> Dict[str, Any]:
    """Serve the draft with vLLM on held-out prompts; compare with the exact offline replay."""
    import torch

    from eagle3x.draft.live import ServedDraft, greedy_rounds, parity, served_counts, summarise
    from eagle3x.draft.ttt import chain_acceptance, shift
    from eagle3x.engines.base import open_engine, vllm_options

    depth, m = settings.depth, settings.max_new_tokens
    prompts = held_out_prompts(plan, settings.prompts)
    if not prompts:
        raise artifacts.ArtifactError(f"{plan.prepared.folder}: no held-out sample has a prompt "
                                      "before its first trained token (data.holdout_samples=0?)")
    longest = max(map(len, prompts)) + m + depth + 2
    options = vllm_options(engine, plan.verifier)
    log.info("eval: serving %s with vLLM on %d held-out prompts (%d new tokens, %d speculative)",
             draft_dir, len(prompts), m, depth)
    served = ServedDraft(plan.verifier.path, draft_dir, depth, options, longest)
    dtype = served.dtype
    try:
        before = served.counters()
        made = served.generate(prompts, m)  # as served: up to m tokens, ending at EOS
        counts = served_counts(before, served.counters(), depth)
        # The same greedy paths, long enough for the last rounds' verification.
        paths = served.generate(prompts, m + depth + 1, ignore_eos=True)
        record = served.record_first_steps(prompts[0], plan.run_dir / "parity.safetensors")
    finally:
        served.close()
    consistent = all(p[:len(q)] == q for p, q in zip(paths, made))

    eng = open_engine(engine, plan.verifier, plan.aux_layer_ids, longest, plan.run_dir)
    try:
        seqs = [p + q for p, q in zip(prompts, paths)]
        feats = []
        for i in range(0, len(seqs), extract.batch_size):
            feats += eng.extract(seqs[i:i + extract.batch_size])
    finally:
        eng.close()

    drafts = accepted = 0
    per_pos = [0] * depth
    agree = total = 0
    every = []  # accepted length from every position of the greedy paths
    for prompt, seq, out, (aux, last) in zip(prompts, seqs, made, feats):
        ids = torch.tensor([seq])
        batch = {"input_ids": ids, "aux_hidden": aux[None].float(), "last_hidden": last[None],
                 "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([len(seq)])}
        nxt = shift(ids, 1, -1)
        acc = chain_acceptance(draft, batch, head, depth, greedy=nxt)["accepted"][0]
        n = len(prompt)
        replay = greedy_rounds(acc.tolist(), n - 1, len(out))
        drafts += replay["num_drafts"]
        accepted += replay["num_accepted_tokens"]
        for j, c in enumerate(replay["accepted_per_pos"]):
            per_pos[j] += c
        every += (acc[n - 1:n - 2 + len(out)] + 1).tolist()
        own = (last.float() @ head.T).argmax(-1)[n - 1:-1]
        agree += int((own == ids[0, n:]).sum())
        total += own.numel()
    offline = summarise(drafts, accepted, per_pos, depth)
    offline["all_positions_mean_accepted_length"] = sum(every) / max(len(every), 1)

    errors = parity(record, draft, feats[0][0], prompts[0], int(record["first"][0]))
    gap = (offline["mean_accepted_length"] / counts["mean_accepted_length"] - 1
           if counts["mean_accepted_length"] and offline["mean_accepted_length"] else None)
    return {"prompts": len(prompts), "max_new_tokens": m, "depth": depth,
            "mean_new_tokens": sum(map(len, made)) / len(made),
            "served": counts, "greedy_offline": offline, "offline_vs_served": gap,
            "speculative_paths_consistent": consistent,
            "verifier_agreement": agree / max(total, 1), "parity": errors,
            "parity_max_rel_error": max(v for k, v in errors.items() if k != "same_first_proposal"),
            "served_dtype": dtype}


def run(plan: RunPlan, eval: EvalConfig, train: TrainConfig, extract: ExtractConfig,
        engine: EngineConfig, hidden: HiddenConfig = HiddenConfig()) -> Outcome:
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
    online = hidden.source is not HiddenSource.offline
    dm = HiddenStateDataModule.from_plan(plan, train, extract, engine if online else None,
                                         hidden if online else None)
    dm.setup()
    try:
        report = evaluate(draft, head, dm.val_dataloader(), eval.depth, eval.max_samples)
    finally:
        dm.close()  # the online engine, before vLLM serves the draft
    report["draft"] = str(draft_dir)
    report["hidden"] = hidden.source.value
    out.mkdir(parents=True, exist_ok=True)
    if eval.live:
        report["live"] = live(plan, eval, extract, engine, draft_dir, draft, head)
    artifacts.write_json_atomic(out / "eval.json", report)
    wandb = sys.modules.get("wandb")  # the train stage of this run opened it, if any
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update(wandb_summary(report))
    log.info("eval: mean accepted length %.3f over %d positions; acceptance per depth %s",
             report["mean_accepted_length"], report["positions"],
             " ".join(f"{r:.2f}" for r in report["acceptance_rate_per_depth"]))
    if "live" in report:
        lv = report["live"]
        log.info("eval live (vLLM, %d prompts): mean accepted length %.3f served, %.3f exact "
                 "offline replay (%+.1f%%); %.3f from every position of the same paths; "
                 "parity with the trained draft: max relative error %.1e (vLLM in %s)",
                 lv["prompts"], lv["served"]["mean_accepted_length"] or 0,
                 lv["greedy_offline"]["mean_accepted_length"] or 0,
                 100 * (lv["offline_vs_served"] or 0),
                 lv["greedy_offline"]["all_positions_mean_accepted_length"],
                 lv["parity_max_rel_error"], lv["served_dtype"])
    return Outcome("eval", "wrote", out / "eval.json")


def wandb_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """The eval figures as W&B summary keys."""
    out = {"eval/mean_accepted_length": report["mean_accepted_length"],
           **{f"eval/accept_rate_{j}": r for j, r in enumerate(report["acceptance_rate_per_depth"])}}
    lv = report.get("live")
    if lv:
        out.update({"eval/live_mean_accepted_length": lv["served"]["mean_accepted_length"],
                    "eval/greedy_mean_accepted_length": lv["greedy_offline"]["mean_accepted_length"],
                    "eval/parity_max_rel_error": lv["parity_max_rel_error"],
                    **{f"eval/live_accept_rate_{j}": r for j, r in
                       enumerate(lv["served"]["acceptance_rate_per_depth"])}})
    return out
