"""What the eval stage writes and says: W&B summary keys and the console lines.

    wandb_summary(report)  eval.json's figures as W&B summary keys
    log_report(report)     the console lines of one eval report
"""

from __future__ import annotations

import logging
from typing import Any, Dict

from eagle3x.config.schema import OfflineEval

log = logging.getLogger("eagle3x")


def log_report(report: Dict[str, Any]) -> None:
    """The offline figure, then the live one and how the two compare (eval.json's keys)."""
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_rate_per_depth"])
    if report["measures"] == OfflineEval.data.value:
        log.info("eval (offline, along the held-out data's replies): mean accepted length %.3f "
                 "over %d positions; acceptance per depth %s", report["mean_accepted_length"],
                 report["positions"], rates)
    else:
        log.info("eval (offline, the verifier's greedy continuations of %d held-out prompts, "
                 "rounds replayed as vLLM runs them): mean accepted length %.3f over %d rounds; "
                 "acceptance per depth %s; %.3f along the held-out data's replies",
                 report["prompts"], report["mean_accepted_length"] or 0, report["drafts"],
                 rates, report["data"]["mean_accepted_length"])
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
        if "offline_estimate_vs_served" in lv:
            log.info("eval: the offline estimate (greedy, engine=%s) is %+.1f%% of vLLM's served "
                     "figure; its greedy continuations are vLLM's on %.0f%% of the prompts",
                     report["engine"], 100 * lv["offline_estimate_vs_served"],
                     100 * lv["offline_paths_same_as_served"])


def wandb_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """The eval figures as W&B summary keys."""
    out = {"eval/mean_accepted_length": report["mean_accepted_length"],
           "eval/offline_measures": report.get("measures", OfflineEval.data.value),
           **{f"eval/accept_rate_{j}": r for j, r in enumerate(report["acceptance_rate_per_depth"])}}
    lv = report.get("live")
    if lv:
        out.update({"eval/live_mean_accepted_length": lv["served"]["mean_accepted_length"],
                    "eval/greedy_mean_accepted_length": lv["greedy_offline"]["mean_accepted_length"],
                    "eval/parity_max_rel_error": lv["parity_max_rel_error"],
                    **{f"eval/live_accept_rate_{j}": r for j, r in
                       enumerate(lv["served"]["acceptance_rate_per_depth"])}})
    return out
