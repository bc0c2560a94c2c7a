"""Stage `eval`: how well a trained draft is accepted, and how much faster it serves.

The library is `eagle3x.evaluation`; this stage reads the config and runs, in order:

1. the offline figure on the held-out split (`evaluation.offline`): `eval.offline=data`
   along the held-out replies, or `greedy` on the verifier's greedy continuations;
2. with `eval.live`, the draft served by vLLM on held-out prompts beside the exact offline
   replay and the drafter's parity (`evaluation.live.serve_and_compare`);
3. with `eval.benchmarks`, each prompt set (`evaluation.benchmarks`) served by vLLM with
   and without the draft: acceptance per temperature, greedy equality, the speedup at
   each `eval.concurrency` (`evaluation.served.run_sets`);
4. eval.json, the W&B summary and table, the console lines (`evaluation.report`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import (EngineConfig, EvalConfig, ExtractConfig, HiddenConfig,
                                   HiddenSource, OfflineEval, TrainConfig)
from eagle3x.plan import RunPlan


def run(plan: RunPlan, eval: EvalConfig, train: TrainConfig, extract: ExtractConfig,
        engine: EngineConfig, hidden: HiddenConfig = HiddenConfig()) -> Outcome:
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.draft.save import load
    from eagle3x.evaluation import live, offline, report as reporting
    from eagle3x.weights import EMBED_NAMES, find_tensor, verifier_head

    out = plan.run_dir
    draft_dir = Path(eval.draft) if eval.draft else out / "draft"
    if not (draft_dir / "config.json").exists():
        raise artifacts.ArtifactError(f"{draft_dir}: no exported draft; train first or set eval.draft")
    vpath = plan.verifier.path
    draft = load(draft_dir, find_tensor(vpath, EMBED_NAMES).float())
    head = verifier_head(vpath, plan.verifier.tied_head).float()

    # 1. The offline figure.
    online = hidden.source is not HiddenSource.offline
    dm = HiddenStateDataModule.from_plan(plan, train, extract, engine if online else None,
                                         hidden if online else None)
    dm.setup()
    try:
        report = offline.evaluate(draft, head, dm.val_dataloader(), eval.depth, eval.max_samples)
    finally:
        dm.close()  # the online engine, before vLLM serves the draft
    report["measures"] = OfflineEval.data.value
    report["measures_what"] = offline.MEASURES[OfflineEval.data]
    out.mkdir(parents=True, exist_ok=True)
    if eval.offline is OfflineEval.greedy:
        data_figure = report
        report = offline.greedy_offline(plan, extract, engine, draft, head, eval.depth,
                                        eval.prompts, eval.max_new_tokens)
        report.update(measures=OfflineEval.greedy.value,
                      measures_what=offline.MEASURES[OfflineEval.greedy], data=data_figure)
    report["draft"] = str(draft_dir)
    report["hidden"] = hidden.source.value
    mine = report.pop("_served", None)

    # 2. The draft served by vLLM.
    if eval.live:
        prompts = offline.held_out(plan, eval.prompts)
        report["live"] = lv = live.serve_and_compare(plan, extract, engine, draft_dir, draft, head,
                                                     prompts, eval.depth, eval.max_new_tokens)
        theirs = lv.pop("_served")
        if mine is not None and lv["served"]["mean_accepted_length"]:
            lv["offline_estimate_vs_served"] = (
                (report["mean_accepted_length"] or 0) / lv["served"]["mean_accepted_length"] - 1)
            # The greedy continuations the estimate scored, against those vLLM served.
            lv["offline_paths_same_as_served"] = (
                sum(a == b for a, b in zip(mine, theirs)) / max(len(theirs), 1))

    # 3. Benchmark sets served by vLLM with and without the draft.
    if eval.benchmarks:
        from eagle3x.evaluation import benchmarks, served
        from eagle3x.engines.base import vllm_options
        from eagle3x.verifier import load_tokenizer

        sets = benchmarks.load(eval.benchmarks, dict(eval.sets or {}), eval.max_prompts,
                               lambda n: offline.held_out(plan, n))
        tokenizer = load_tokenizer(vpath, plan.verifier.trust_remote_code)
        positions = plan.verifier.info.raw.get("max_position_embeddings")
        report["benchmarks"] = served.run_sets(
            vpath, draft_dir, sets, tokenizer, dict(plan.source.template_kwargs), eval.depth,
            list(eval.temperatures), eval.max_new_tokens, list(eval.concurrency),
            vllm_options(engine, plan.verifier), eval.seed,
            int(positions) if positions else None)

    # 4. What is written and said.
    artifacts.write_json_atomic(out / "eval.json", report)
    wandb = sys.modules.get("wandb")  # the train stage of this run opened it, if any
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update(reporting.wandb_summary(report))
        if "benchmarks" in report:
            reporting.wandb_log(wandb, report["benchmarks"])
    reporting.log_report(report)
    if "benchmarks" in report:
        reporting.log_benchmarks(report["benchmarks"])
    return Outcome("eval", "wrote", out / "eval.json")
