"""CPU step time and memory of the draft's training step, this checkout against another one,
side by side in one run.

    git worktree add /tmp/base <commit>            # the checkout to compare with
    python bench/ttt_speed.py --baseline /tmp/base [--rounds 3]

Each (checkout, attention path, case) point runs in a fresh process with one torch thread
(this 2-core VM is shared; two OpenMP threads stall on each other whenever a neighbour
takes a core): one untimed forward+backward of `ttt_step_metrics` on the case's batch, then
`--reps` timed ones; the figure is the least process CPU time of a step over all rounds
(rounds alternate the checkouts, so a busy period hits both), and the RSS growth of the
process over what it held before the first step (VmHWM reset, as bench/ttt_memory.py).
This checkout runs both attention paths (train.attention=reference and fused); the
baseline runs whatever it has.

Cases: the embedded default's batch (H=128, 8 packed conversations of 55-140 tokens, 4 TTT
steps, draft vocab 256 of 1024), and bench/ttt_memory.py's small draft (H=256, 4 heads,
MLP 688, draft vocab 4096 of 32000, 7 TTT steps) on one sequence of T=512 and T=2048.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "default batch (H=128, 8 packed conversations, 4 steps)":
        dict(h=128, heads=2, inter=256, vd=256, vt=1024, steps=4,
             docs=[87, 120, 64, 95, 140, 77, 101, 55]),
    "T=512, one sequence (H=256, 7 steps)":
        dict(h=256, heads=4, inter=688, vd=4096, vt=32000, steps=7, docs=[512]),
    "T=2048, one sequence (H=256, 7 steps)":
        dict(h=256, heads=4, inter=688, vd=4096, vt=32000, steps=7, docs=[2048]),
}

CHILD = r'''
import json, re, sys, time
import torch
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
from eagle3x.data.datamodule import collate_packed
from eagle3x.draft.model import DraftShape, Eagle3Draft
from eagle3x.draft.ttt import ttt_step_metrics
import eagle3x.draft.model as model
if cfg["impl"] != "baseline":
    model.Attention.impl = cfg["impl"]
h, vd, vt = cfg["h"], cfg["vd"], cfg["vt"]
s = DraftShape(hidden_size=h, target_hidden_size=h, intermediate_size=cfg["inter"],
               num_heads=cfg["heads"], num_kv_heads=cfg["heads"], head_dim=h // cfg["heads"],
               draft_vocab_size=vd, target_vocab_size=vt)
torch.manual_seed(0)
draft = Eagle3Draft(s, torch.zeros(vd, dtype=torch.long), torch.arange(vt) < vd)
draft.embed_tokens.weight.requires_grad_(False)
head = torch.randn(vt, h) * 0.02
g = torch.Generator().manual_seed(0)
samples = [{"input_ids": torch.randint(0, vt, (n,), generator=g),
            "loss_mask": torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
            "aux_hidden": torch.randn(n, 3 * h, generator=g),
            "last_hidden": torch.randn(n, h, generator=g)} for n in cfg["docs"]]
try:  # this checkout's loader hands each step's trained positions over with the batch
    batch = collate_packed(samples, steps=cfg["steps"])
except TypeError:
    batch = collate_packed(samples)
def kb(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
base = kb("VmRSS")
def step():
    m = ttt_step_metrics(draft, batch, head, cfg["steps"], 0.8)
    m["loss"].backward()
    draft.zero_grad(set_to_none=True)
step()
times = []
for _ in range(cfg["reps"]):
    t0 = time.process_time()
    step()
    times.append(time.process_time() - t0)
print(json.dumps({"cpu_s": min(times), "rss_growth_mb": (kb("VmHWM") - base) / 1024}))
'''


def point(tree: str, impl: str, case: dict, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dict(case, impl=impl, reps=reps))],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{tree} ({impl}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True, help="another checkout of eagle3x")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    runs = [("baseline", args.baseline, "baseline"), ("reference", str(REPO), "reference"),
            ("fused", str(REPO), "fused")]
    table = {}
    for name, case in CASES.items():
        best = {label: None for label, _, _ in runs}
        for _ in range(args.rounds):
            for label, tree, impl in runs:
                r = point(tree, impl, case, args.reps)
                b = best[label]
                best[label] = r if b is None else {"cpu_s": min(b["cpu_s"], r["cpu_s"]),
                                                   "rss_growth_mb": min(b["rss_growth_mb"],
                                                                        r["rss_growth_mb"])}
        table[name] = best
        base = best["baseline"]["cpu_s"]
        print(f"{name}: " + ", ".join(
            f"{label} {v['cpu_s'] * 1000:.0f} ms ({base / v['cpu_s']:.2f}x), "
            f"{v['rss_growth_mb']:.0f} MB" for label, v in best.items()), flush=True)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
