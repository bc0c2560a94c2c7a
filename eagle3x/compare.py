"""Compare the jobs of a sweep: a table (one row per job) and a plot.

    python -m eagle3x.compare multirun/2026-12-02/14-48-33          # a Hydra sweep folder
    python -m eagle3x.compare my-sweep --wandb-dir wandb             # a W&B group, offline runs
    python -m eagle3x.compare my-sweep --wandb-api --entity me       # a W&B group, from the API

Rows are sorted by the swept keys (the overrides that differ between jobs). Columns: the
swept values, train samples and tokens, val acc_0, expected and measured accepted
length (offline, and vLLM's own with `eval.live`), wall time, and with `eval.benchmarks`
`<set>/accept_len_t<T>`, `<set>/greedy_identical` and `<set>/speedup_c<N>` per set. Writes compare.csv and compare.png (accepted length and acc_0 against
the swept value) next to the inputs, or under --out; with --log-wandb the table and plot
also go to W&B (a `wandb.Table` and an image in a run of job type `compare`).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


def _num(v: str) -> Any:
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def _overrides_dict(overrides: Sequence[str]) -> Dict[str, str]:
    return dict(o.split("=", 1) for o in overrides if "=" in o and not o.startswith("hydra"))


def rows_from_folder(folder: Path) -> List[Dict[str, Any]]:
    """One row per summary.json under a sweep folder."""
    rows = []
    for path in sorted(folder.rglob("summary.json")):
        s = json.loads(path.read_text())
        rows.append({"job": str(path.parent.relative_to(folder)), "overrides": s.get("overrides", []),
                     "train_samples": s.get("train_samples"), "train_tokens": s.get("train_tokens"),
                     "acc_0": (s.get("acc") or {}).get("acc_0"),
                     "val_accept_len": s.get("val_accept_len"),
                     "eval_accepted_length": s.get("eval_accepted_length"),
                     "live_accepted_length": s.get("live_accepted_length"),
                     "seconds": round(sum((s.get("stage_seconds") or {}).values()), 1),
                     "hidden": (s.get("artifacts") or {}).get("hidden", {}).get("status"),
                     **benchmark_columns(s.get("benchmarks") or [])})
    return fill(rows)


#: The benchmark columns compare shows of each set (eval.json's rows carry more).
BENCHMARK_COLUMNS = ("accept_len_t", "greedy_identical", "speedup_c")


def benchmark_columns(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """`<set>/<column>` of each benchmark set's row (summary.json's ``benchmarks``): the
    accepted length at each temperature, greedy equality, the speedup at each concurrency."""
    return {f"{r['set']}/{k}": v for r in rows for k, v in r.items()
            if k != "set" and k.startswith(BENCHMARK_COLUMNS)}


def fill(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every row with every column (None where a job has no such figure), in first-seen order."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [{c: r.get(c) for c in cols} for r in rows]


def _row_from_run(run: Dict[str, Any], name: str) -> Dict[str, Any]:
    summary, config = run["summary"], run.get("config", {})
    return {"job": name, "overrides": run.get("tags") or [],
            "train_samples": (config.get("data") or {}).get("num_samples"), "train_tokens": None,
            "acc_0": summary.get("val/acc_0"), "val_accept_len": summary.get("val/accept_len"),
            "eval_accepted_length": summary.get("eval/mean_accepted_length"),
            "live_accepted_length": summary.get("eval/live_mean_accepted_length"),
            "seconds": summary.get("_runtime"), "hidden": None,
            **{k[len("eval/"):]: v for k, v in summary.items()
               if k.startswith("eval/") and k.count("/") == 2
               and k.split("/")[2].startswith(BENCHMARK_COLUMNS)}}


def rows_from_wandb_offline(root: Path, group: str) -> List[Dict[str, Any]]:
    from eagle3x.tracking.offline import read_run

    rows = []
    for folder in sorted(root.rglob("offline-run-*")):
        run = read_run(folder)
        if run.get("group") == group:
            rows.append(_row_from_run(run, run.get("name") or run["id"]))
    return fill(rows)


def rows_from_wandb_api(group: str, project: str, entity: Optional[str]) -> List[Dict[str, Any]]:
    import wandb

    api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    rows = []
    for r in api.runs(path, filters={"group": group}):
        rows.append(_row_from_run({"summary": dict(r.summary), "config": dict(r.config),
                                   "tags": list(r.tags)}, r.name))
    return fill(rows)


def swept_keys(rows: List[Dict[str, Any]]) -> List[str]:
    """Override keys whose value differs between rows."""
    maps = [_overrides_dict(r["overrides"]) for r in rows]
    keys = sorted({k for m in maps for k in m})
    return [k for k in keys if len({m.get(k) for m in maps}) > 1]


def table(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    keys = swept_keys(rows)
    out = []
    for r in rows:
        o = _overrides_dict(r["overrides"])
        out.append({**{k: _num(o.get(k, "")) for k in keys},
                    **{k: v for k, v in r.items() if k != "overrides"}})
    return sorted(out, key=lambda r: tuple((0, r[k]) if isinstance(r[k], (int, float)) else (1, str(r[k]))
                                           for k in keys))


def format_table(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return "(no jobs)"
    cols = list(rows[0])
    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
    widths = {c: max(len(c), *(len(cell(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(cell(r[c]).rjust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], x: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r[x] for r in rows]
    fig, ax1 = plt.subplots(figsize=(6, 4))
    for key, style in (("eval_accepted_length", "o-"), ("live_accepted_length", "D-"),
                       ("val_accept_len", "s--")):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax1.plot(xs, [float("nan") if y is None else y for y in ys], style, label=key)
    ax1.set_xlabel(x)
    ax1.set_ylabel("accepted length (tokens / verifier pass)")
    if all(isinstance(v, (int, float)) and v > 0 for v in xs) and max(xs) / max(min(xs), 1) >= 10:
        ax1.set_xscale("log")
    ax2 = ax1.twinx()
    ax2.plot(xs, [float("nan") if r["acc_0"] is None else r["acc_0"] for r in rows], "^:",
             color="tab:green", label="acc_0")
    ax2.set_ylabel("acc_0")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="lower right")
    ax1.set_title("eagle3x sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_to_wandb(rows: List[Dict[str, Any]], image: Path, group: str, project: str) -> None:
    import wandb

    run = wandb.init(project=project, group=group, job_type="compare", name=f"compare-{group}",
                     mode=None)
    cols = list(rows[0])
    tbl = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])
    run.log({"compare/table": tbl, "compare/plot": wandb.Image(str(image))})
    x = swept_keys_from(rows)
    if x and "eval_accepted_length" in cols:
        run.log({"compare/accepted_length": wandb.plot.line(tbl, x, "eval_accepted_length",
                                                            title="accepted length")})
    run.finish()


def swept_keys_from(rows: List[Dict[str, Any]]) -> Optional[str]:
    fixed = {"job", "train_samples", "train_tokens", "acc_0", "val_accept_len",
             "eval_accepted_length", "live_accepted_length", "seconds", "hidden"}
    keys = [k for k in rows[0] if k not in fixed]
    return keys[0] if keys else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3x.compare", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a sweep folder (multirun/...) or a W&B group name")
    p.add_argument("--wandb-dir", default="wandb", help="where offline W&B runs live (for a group)")
    p.add_argument("--wandb-api", action="store_true", help="read the group from the W&B API")
    p.add_argument("--project", default="eagle3x")
    p.add_argument("--entity")
    p.add_argument("--out", help="folder for compare.csv / compare.png (default: the source folder)")
    p.add_argument("--log-wandb", action="store_true", help="also log table and plot to W&B")
    args = p.parse_args(argv)
    src = Path(args.source)
    if src.is_dir():
        rows, out, group = rows_from_folder(src), Path(args.out or src), src.name
    elif args.wandb_api:
        rows, out, group = rows_from_wandb_api(args.source, args.project, args.entity), \
            Path(args.out or "."), args.source
    else:
        rows, out, group = rows_from_wandb_offline(Path(args.wandb_dir), args.source), \
            Path(args.out or "."), args.source
    if not rows:
        print(f"eagle3x.compare: no finished jobs found in {args.source}", file=sys.stderr)
        return 1
    rows = table(rows)
    print(format_table(rows))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    x = swept_keys_from(rows) or "train_samples"
    image = plot(rows, x, out / "compare.png")
    print(f"\nwrote {out / 'compare.csv'} and {image}")
    if args.log_wandb:
        log_to_wandb(rows, image, group, args.project)
    return 0


if __name__ == "__main__":
    sys.exit(main())
