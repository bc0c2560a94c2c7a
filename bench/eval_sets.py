"""Drafts compared as users compare them (issue 32): acceptance on several prompt sets at
temperatures 0 and 0.6, k = 3 and 5, and the speedup vLLM serves at several concurrencies,
on SmolLM2-135M-Instruct, one `stage=eval` with `eval.benchmarks` per draft and k:

    python bench/eval_sets.py --draft eagle3x=RUN/draft --draft peer=PEER/draft
    python bench/eval_sets.py --draft mine=RUN/draft --speed mine --concurrency 1,4,16

--draft NAME=FOLDER (repeatable): an exported draft in any layout `draft.init` reads. A
folder that is not eagle3x's own export (speculators', EAGLE's, ModelOpt's) is converted
first by `python -m eagle3x stage=export draft.init=FOLDER` (the fine-tune guide's
conversion: the weights as stored, the draft's own vocabulary map), so every draft is
served by the same code path.

The sets: `held_out` (the run data's first held-out prompts: --data, as bench/quality.py
reads it, default the verifier's regenerated replies) and the three local sets in
bench/prompts/, one per registry build: `maths` (a `question` per record, GSM8K's shape),
`code` (a function to complete, HumanEval's `prompt` and build), `chat2` (two user turns,
MT-Bench's shape: the second follows the verifier's own first reply). Written for this
bench, 16 prompts each; no download. `--max-prompts` per set.

Per draft and k: acceptance (vLLM's counters) per set and temperature, and whether greedy
output with the draft equals greedy output without it. `--speed NAME`: that draft's eval at
the first k also measures the speed at each `--concurrency` (held_out only: EOS ignored,
`--max-new-tokens` each, closed loop), with and without the draft, same engine settings;
`--speed-only` skips the acceptance runs (a second call after the first).
Prints two markdown tables; records to --out/results.json; each eval.json stays in its
folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import quality  # noqa: E402  (bench/quality.py: the SmolLM2 base command and its runner)

SETS = {
    "maths": f"{{path:{HERE / 'prompts' / 'maths.jsonl'},field:question}}",
    "code": f"{{path:{HERE / 'prompts' / 'code.jsonl'},field:prompt,build:humaneval}}",
    "chat2": f"{{path:{HERE / 'prompts' / 'chat2.jsonl'},field:prompt,build:turns}}",
}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--draft", action="append", default=[], required=True, help="NAME=FOLDER, repeatable")
    a("--data", default="regenerated", help="the held-out set's data (bench/quality.py --data)")
    a("--depths", default="3,5")
    a("--temperatures", default="0,0.6")
    a("--max-prompts", type=int, default=16)
    a("--speed", action="append", default=[], help="NAME of a draft whose speed is measured")
    a("--concurrency", default="1,4,16")
    a("--max-new-tokens", type=int, default=64)
    a("--speed-only", action="store_true",
      help="only the speed runs of the --speed drafts (their acceptance measured before)")
    a("--out", default=None, help="default $EAGLE3X_CACHE/quality/runs/eval_sets")
    args, rest = p.parse_known_args(argv)
    args.rest = rest  # passed on to bench/quality.py (--threads, --set, --store)
    args.drafts = dict(d.split("=", 1) for d in args.draft)
    return args


def is_eagle3x(folder: Path) -> bool:
    cfg = json.loads((folder / "config.json").read_text())
    return "eagle3x" in cfg


def main() -> None:
    args = parse()
    q = quality.parse(["--data", args.data, "--max-new-tokens", str(args.max_new_tokens),
                       *args.rest])
    import smollm2  # bench/smollm2.py

    q.verifier_path = str(smollm2.build(smollm2.default_folder()))
    quality.THREADS["n"] = q.threads
    out = Path(args.out) if args.out else q.out.parent / "eval_sets"
    out.mkdir(parents=True, exist_ok=True)
    base = quality.base_overrides(q, args.data)
    sets = ",".join(f"{k}:{v}" for k, v in SETS.items())
    records: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    for name, folder in args.drafts.items():
        draft = Path(folder).resolve()
        if not is_eagle3x(draft):
            conv = out / name / "converted"
            if not (conv / "draft" / "config.json").exists():
                quality.log(f"{name}: converting {draft} (stage=export draft.init=...)")
                rc, _ = quality.eagle3x(["stage=export", *base, f"draft.init={draft}",
                                         f"train.output_dir={conv}", f"hydra.run.dir={conv}/hydra"],
                                        out / name / "convert.log", q)
                if rc != 0:
                    sys.exit(f"eval_sets: converting {draft} failed: {quality.tail(out / name / 'convert.log')}")
            draft = conv / "draft"
        for i, k in enumerate(int(x) for x in args.depths.split(",")):
            speed = name in args.speed and i == 0
            run = out / name / f"k{k}"
            argv = ["stage=eval", *base, f"train.output_dir={run}", f"hydra.run.dir={run}/hydra",
                    f"eval.draft={draft}", f"eval.depth={k}", "engine=hf",
                    f"eval.benchmarks=[held_out,{','.join(SETS)}]", f"eval.sets={{{sets}}}",
                    f"eval.max_prompts={args.max_prompts}",
                    f"eval.temperatures=[{args.temperatures}]", "eval.concurrency=[]"]
            rec: Dict[str, Any] = {"draft": name, "folder": str(draft), "k": k,
                                   "command": "python -m eagle3x " + " ".join(argv)}
            if args.speed_only and not speed:
                continue
            if not args.speed_only:
                quality.log(f"{name}: eval k={k} (acceptance per set and temperature)")
                rc, wall = quality.eagle3x(argv, run.parent / f"k{k}.log", q)
                rec["wall_seconds"] = wall
                if rc != 0:
                    rec["error"] = quality.tail(run.parent / f"k{k}.log")
                    quality.log(f"{name}: eval k={k} failed: {rec['error']}")
                else:
                    rec["benchmarks"] = quality.read_json(run / "eval.json").get("benchmarks")
            if speed:
                srun = out / name / f"k{k}-speed"
                sargv = [a for a in argv if not a.startswith(("eval.benchmarks", "eval.sets",
                                                              "eval.temperatures", "eval.concurrency",
                                                              "train.output_dir", "hydra.run.dir"))]
                sargv += [f"train.output_dir={srun}", f"hydra.run.dir={srun}/hydra",
                          "eval.benchmarks=[held_out]", "eval.temperatures=[0]",
                          f"eval.concurrency=[{args.concurrency}]"]
                quality.log(f"{name}: eval k={k} speed at concurrency {args.concurrency}")
                rc, _ = quality.eagle3x(sargv, srun.parent / f"k{k}-speed.log", q)
                rec["speed_command"] = "python -m eagle3x " + " ".join(sargv)
                if rc == 0:
                    rec["speed"] = quality.read_json(srun / "eval.json").get("benchmarks")
                else:
                    rec["speed_error"] = quality.tail(srun.parent / f"k{k}-speed.log")
            records.append(rec)
            (out / "results.json").write_text(json.dumps(records, indent=1, default=str))
    print()
    print("| draft | k | set | prompts | " + " | ".join(f"T={t}" for t in args.temperatures.split(","))
          + " | per position (T=0) | greedy identical |")
    print("|---|---|---|---|" + "---|" * len(args.temperatures.split(",")) + "---|---|")
    for r in records:
        for s in ((r.get("benchmarks") or {}).get("sets") or {}).values():
            acc = s["acceptance"]
            print(f"| {r['draft']} | {r['k']} | {s['set']} | {s['prompts']} | "
                  + " | ".join(quality.fmt(a["mean_accepted_length"]) for a in acc)
                  + f" | {' '.join(f'{x:.2f}' for x in acc[0]['acceptance_rate_per_depth'])}"
                  + f" | {s['greedy_identical']:.2f} |")
    for r in records:
        sp = r.get("speed")
        if not sp:
            continue
        print(f"\nspeed, {r['draft']} at k={r['k']} ({sp.get('device')}; "
              f"{args.max_new_tokens} tokens a request, EOS ignored):")
        print("| set | concurrency | tok/s without | tok/s with | speedup | TPOT ms median without / with "
              "| TTFT ms median without / with |")
        print("|---|---|---|---|---|---|---|")
        for s in sp["sets"].values():
            for c in s["speed"]:
                w, d = c["without"], c["with"]
                print(f"| {s['set']} | {c['concurrency']} | {w['output_tokens_per_s']:.1f} | "
                      f"{d['output_tokens_per_s']:.1f} | {c['speedup']:.2f} | "
                      f"{w['tpot_ms_median']:.1f} / {d['tpot_ms_median']:.1f} | "
                      f"{w['ttft_ms_median']:.0f} / {d['ttft_ms_median']:.0f} |")
    print(f"\nall: {time.perf_counter() - t0:.0f} s; results -> {out / 'results.json'}")


if __name__ == "__main__":
    main()
