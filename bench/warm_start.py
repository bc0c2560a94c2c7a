"""A published draft fine-tuned on new data against a draft trained from scratch on it, at
equal steps, as vLLM serves both (issue 33):

    python bench/warm_start.py                                   # SmolLM2, see below
    python bench/warm_start.py --init /path/to/draft --steps 25,50,100,200 --depths 3,5
    python bench/warm_start.py --remap-steps 50,200              # also the re-mapped vocabulary

1. The source draft (`--init`, else trained here): eagle3x's defaults on `--source` (the
   bundled replies, `original`) for `--source-steps` steps. It stands for the published
   draft a user starts from: trained on other text than the user's.
2. For each N in `--steps`, on `--data` (the verifier's own replies, `regenerated`):
   `scratch` (eagle3x's defaults, N steps) and `warm` (the same with `draft.init=<source>`:
   every weight and the source's vocabulary map kept, optimizer and schedule fresh, N
   steps). With `--remap-steps`, also `remap` at those N (`vocab.remap=true`: a new map
   from the new data, the lm_head rows moved by token id, rows of new tokens from the
   verifier's lm_head). Each N is its own complete run (its schedule ends at N), as a user
   who trains N steps gets it.
3. Each draft is served by vLLM beside SmolLM2 on the same held-out prompts (bench/quality.py's
   eval: float32, eager, greedy, `--prompts` prompts, 64 new tokens) at each k in --depths.

Printed: one row per N: the mean accepted length of each recipe at each k, and the verdict
of the issue's goal (the warm start at <= 50 steps reaches the scratch draft's acceptance
at the largest N). Records go to --out/results.json. Runs are reused (bench/quality.py's
rule: a folder that holds a trained draft is served again, not retrained).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (bench/quality.py: the runs and their vLLM eval)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--init", default=None, help="the draft to start from (default: train one on --source)")
    a("--source", default="original", help="data of the source draft (bench/quality.py --data)")
    a("--source-steps", type=int, default=200)
    a("--data", default="regenerated", help="the new data (bench/quality.py --data)")
    a("--steps", default="25,50,100,200", help="comma-separated step counts")
    a("--remap-steps", default="", help="step counts that also train a re-mapped warm start")
    a("--recipes", default="scratch,warm", help="which of scratch, warm to train at each N "
      "(two processes can split them; remap follows --remap-steps)")
    a("--depths", default="3")
    a("--seed", type=int, default=0)
    a("--prompts", type=int, default=32)
    a("--out", default=None, help="default $EAGLE3X_CACHE/quality/runs/warm_start")
    args, rest = p.parse_known_args(argv)
    args.rest = rest  # passed on to bench/quality.py (e.g. --threads, --set)
    args.steps = [int(s) for s in args.steps.split(",") if s]
    args.remap_steps = [int(s) for s in args.remap_steps.split(",") if s]
    return args


def quality_args(args: argparse.Namespace, data: str, steps: int) -> argparse.Namespace:
    q = quality.parse(["--data", data, "--steps", str(steps), "--depths", args.depths,
                       "--seeds", str(args.seed), "--prompts", str(args.prompts),
                       *([f"--out={args.out}"] if args.out else []), *args.rest])
    import smollm2  # bench/smollm2.py

    q.verifier_path = str(smollm2.build(smollm2.default_folder()))
    return q


def run(q: argparse.Namespace, data: str, name: str, extra: List[str], folder: Path,
        seed: int) -> Dict[str, Any]:
    rec = quality.eagle3x_train(q, data, name, extra, seed, folder)
    if "error" not in rec:
        quality.eagle3x_eval(q, rec)
    return rec


def accepted(rec: Dict[str, Any], k: int) -> Optional[float]:
    return ((rec.get("depths") or {}).get(k) or {}).get("vllm")


def main() -> None:
    args = parse()
    q0 = quality_args(args, args.data, args.steps[0])
    out = q0.out.parent / "warm_start" if args.out is None else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quality.THREADS["n"] = q0.threads
    t0 = time.perf_counter()
    records: List[Dict[str, Any]] = []

    def save() -> None:
        (out / "results.json").write_text(json.dumps({"args": vars(args), "records": records},
                                                     indent=1, default=str))

    init = args.init
    if init is None:
        qs = quality_args(args, args.source, args.source_steps)
        src = run(qs, qs.data[0], "source", [], out / "source" / f"seed{args.seed}", args.seed)
        src["steps_asked"] = args.source_steps
        records.append(src)
        save()
        if "error" in src:
            sys.exit(f"warm_start: the source draft failed: {src['error']}")
        init = str(out / "source" / f"seed{args.seed}" / "draft")
    quality.log(f"source draft: {init}")
    for n in args.steps:
        q = quality_args(args, args.data, n)
        plan = [(m, x) for m, x in (("scratch", []), ("warm", [f"draft.init={init}"]))
                if m in args.recipes.split(",")]
        if n in args.remap_steps:
            plan.append(("remap", [f"draft.init={init}", "vocab.remap=true"]))
        for name, extra in plan:
            rec = run(q, q.data[0], name, extra, out / name / f"s{n}", args.seed)
            rec["steps_asked"] = n
            records.append(rec)
            save()
    q0.depths = [int(k) for k in args.depths.split(",")]
    print()
    names = ["scratch", "warm", "remap"]
    for k in q0.depths:
        print(f"vLLM mean accepted length at k={k} ({args.data}, seed {args.seed}, "
              f"{args.prompts} held-out prompts):")
        print("| steps | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for n in args.steps:
            row = {r["recipe"]: accepted(r, k) for r in records if r.get("steps_asked") == n}
            print(f"| {n} | " + " | ".join(quality.fmt(row.get(m)) for m in names) + " |")
        top = max(args.steps)
        target = next((accepted(r, k) for r in records
                       if r["recipe"] == "scratch" and r.get("steps_asked") == top), None)
        early = [n for n in args.steps if n <= 50 and target is not None and any(
            r["recipe"] in ("warm", "remap") and r.get("steps_asked") == n and (accepted(r, k) or 0) >= target
            for r in records)]
        print(f"goal (warm or remap at <= 50 steps >= scratch at {top}: {quality.fmt(target)}): "
              + (f"met at {min(early)} steps" if early else "not met") + "\n")
    print(f"all runs: {time.perf_counter() - t0:.0f} s; results -> {out / 'results.json'}")


if __name__ == "__main__":
    main()
