"""What the eval stage writes and says: W&B summary keys and the console lines.

    wandb_summary(report)   eval.json's figures as W&B summary keys
    log_report(report)      the console lines of one eval report
    benchmark_rows(bench)   one flat row per benchmark set (console table, W&B table,
                            eagle3x.compare's columns)
    benchmark_table, log_benchmarks, wandb_log
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

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
        said = rounds_line(lv.get("rounds"), lv["depth"])
        if said:
            log.info("eval live: %s", said)
        if "offline_estimate_vs_served" in lv:
            log.info("eval: the offline estimate (greedy, engine=%s) is %+.1f%% of vLLM's served "
                     "figure; its greedy continuations are vLLM's on %.0f%% of the prompts",
                     report["engine"], 100 * lv["offline_estimate_vs_served"],
                     100 * lv["offline_paths_same_as_served"])


def rounds_line(rounds: Any, depth: int) -> str:
    """How vLLM's rounds compare with the replay's, request by request (`live.rounds`,
    from `evaluation.live.compare_rounds`), in words; empty where vLLM gave none."""
    if not rounds or not rounds["requests"]:
        return ""
    n, same = rounds["requests"], rounds["same_rounds"]
    if same == n:
        said = f"vLLM's rounds are the replay's, round for round, on all {n} prompts"
    else:
        said = f"vLLM's rounds are the replay's on {same} of {n} prompts"
        d = rounds["departures"][0] if rounds["departures"] else None
        if d and d["served"] is not None and d["replayed_accepted"] is not None:
            said += (f"; the first that differs (prompt {d['prompt']}) departs at round "
                     f"{d['round'] + 1}, where vLLM accepted {d['served'][1]} of "
                     f"{d['served'][0]} and the trained draft's replay {d['replayed_accepted']}")
        elif d:
            said += (f"; prompt {d['prompt']} took {d['rounds'][0]} rounds in vLLM and "
                     f"{d['rounds'][1]} in the replay")
        if not rounds["short_rounds"]:
            said += (" (no round was cut short: there vLLM's drafter proposed tokens that "
                     "the trained draft, replayed on the same path, does not)")
    if rounds["short_rounds"]:
        k = rounds["short_rounds"]
        said += (f"; {k} round{'s' if k != 1 else ''} verified fewer than {depth} proposals "
                 f"(vLLM's scheduler cut {'them' if k != 1 else 'it'})")
    return said


def wandb_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """The eval figures as W&B summary keys."""
    out = {"eval/mean_accepted_length": report["mean_accepted_length"],
           "eval/offline_measures": report.get("measures", OfflineEval.data.value),
           **{f"eval/accept_rate_{j}": r for j, r in enumerate(report["acceptance_rate_per_depth"])}}
    for row in benchmark_rows(report["benchmarks"]) if report.get("benchmarks") else []:
        out.update({f"eval/{row['set']}/{k}": v for k, v in row.items() if k != "set"})
    lv = report.get("live")
    if lv:
        out.update({"eval/live_mean_accepted_length": lv["served"]["mean_accepted_length"],
                    "eval/greedy_mean_accepted_length": lv["greedy_offline"]["mean_accepted_length"],
                    "eval/parity_max_rel_error": lv["parity_max_rel_error"],
                    **{f"eval/live_accept_rate_{j}": r for j, r in
                       enumerate(lv["served"]["acceptance_rate_per_depth"])}})
    return out


def _t(x: float) -> str:
    return f"{x:g}"


def benchmark_rows(bench: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One flat row per benchmark set (eval.json's ``benchmarks``): prompts, the mean
    accepted length at each temperature, the share of greedy outputs identical with and
    without the draft, and at each concurrency the output tokens/s without and with the
    draft, their ratio, the median time per output token and the mean accepted length
    there (greedy, EOS ignored)."""
    rows = []
    for key, s in bench["sets"].items():
        row: Dict[str, Any] = {"set": key, "prompts": s["prompts"]}
        for a in s["acceptance"]:
            # a figure the engine is known to get wrong is left out (served.sampling_fault)
            row[f"accept_len_t{_t(a['temperature'])}"] = (None if a.get("invalid")
                                                           else a["mean_accepted_length"])
        row["greedy_identical"] = s["greedy_identical"]
        for sp in s["speed"]:
            c = sp["concurrency"]
            row[f"tok_s_without_c{c}"] = sp["without"]["output_tokens_per_s"]
            row[f"tok_s_with_c{c}"] = sp["with"]["output_tokens_per_s"]
            row[f"tpot_ms_without_c{c}"] = sp["without"]["tpot_ms_median"]
            row[f"tpot_ms_with_c{c}"] = sp["with"]["tpot_ms_median"]
            row[f"speedup_c{c}"] = sp["speedup"]
            row[f"accept_len_c{c}"] = sp["with"].get("mean_accepted_length")
        rows.append(row)
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def benchmark_table(bench: Dict[str, Any]) -> str:
    """The console table: a header and one line per set."""
    rows = benchmark_rows(bench)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, width))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, width)) for line in cells]
    return "\n".join(lines)


def log_benchmarks(bench: Dict[str, Any]) -> None:
    log.info("eval benchmarks (vLLM on %s, %s; depth %d, %d new tokens, EOS ignored for "
             "speed; accept_len: mean accepted length; speedup: output tokens/s with the "
             "draft over without):\n%s", bench["device"], bench["served_dtype"], bench["depth"],
             bench["max_new_tokens"], benchmark_table(bench))
    if bench.get("sampling_fault"):
        log.warning("eval benchmarks: accept_len at temperature > 0 left out ('-'): %s",
                    bench["sampling_fault"])


def wandb_log(wandb: Any, bench: Dict[str, Any]) -> None:
    """The benchmark rows as a W&B table, and a bar plot of each set's speedup at the
    first concurrency."""
    rows = benchmark_rows(bench)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
    logged: Dict[str, Any] = {"eval/benchmarks": table}
    if bench["concurrency"]:
        c = bench["concurrency"][0]
        logged["eval/benchmark_speedup"] = wandb.plot.bar(
            table, "set", f"speedup_c{c}", title=f"speedup with the draft (concurrency {c}, "
                                                 f"{bench['device']})")
    wandb.run.log(logged)
