"""Stage regenerate's speed and its stop: conversations/s and tokens/s per engine and batch
size, and the seconds from SIGTERM to the process's exit.

    python bench/regenerate.py --conversations 64 --max-new-tokens 256
    python bench/regenerate.py --engines hf --batch-sizes 1,16 --sigterm-after 60 \
        --set regenerate.turns=last

Each case is a real ``python -m eagle3x stage=regenerate`` on the first `--conversations`
bundled sample conversations (eagle3x/resources/sample_conversations.jsonl), a fresh
output folder each, greedy. The verifier is SmolLM2-135M-Instruct built by
bench/smollm2.py (``--verifier PATH`` for another folder). ``engine=hf`` with
``regenerate.batch_size=1`` is one reply at a time (what the transformers engine did
before batching); vLLM runs with ``engine.enforce_eager=true``. The rates are the run's
own (manifest ``stats``: tokens over the seconds after the engine was ready);
conversations/s is conversations over those same seconds. ``--sigterm-after S``: one more
run per engine, sent SIGTERM S seconds after its engine is ready; printed: the seconds to
exit, the exit status, the conversations kept. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]


def data_file(folder: Path, n: int) -> Path:
    src = REPO / "eagle3x" / "resources" / "sample_conversations.jsonl"
    lines = [x for x in src.read_text().splitlines() if x.strip()][:n]
    out = folder / f"conversations-{n}.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def command(args: argparse.Namespace, data: Path, out: Path, engine: str, batch: int) -> List[str]:
    cmd = [sys.executable, "-m", "eagle3x", "stage=regenerate", "verifier=local",
           f"verifier.path={args.verifier}", f"data.path={data}", "data=jsonl",
           f"engine={engine}", f"regenerate.max_new_tokens={args.max_new_tokens}",
           f"regenerate.output_dir={out}", f"engine.dtype={args.dtype}",
           f"hydra.run.dir={out}-job"]
    if engine == "hf":
        cmd.append(f"regenerate.batch_size={batch}")
    else:
        cmd += ["engine.enforce_eager=true", "engine.gpu_memory_utilization=0.3"]
    return cmd + list(args.set)


def environment(threads: int) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="offline")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def measure(args, data: Path, root: Path, engine: str, batch: int) -> Dict[str, float]:
    out = root / f"{engine}-b{batch}"
    t = time.perf_counter()
    r = subprocess.run(command(args, data, out, engine, batch), capture_output=True, text=True,
                       env=environment(args.threads), cwd=root)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{engine} b{batch} failed:\n{r.stderr[-3000:]}")
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    seconds = stats["new_tokens"] / stats["tokens_per_second"]
    return {"conversations": stats["conversations"], "replies": stats["replies"],
            "new_tokens": stats["new_tokens"], "seconds": seconds, "wall": wall,
            "conv_s": stats["conversations"] / seconds, "tok_s": stats["tokens_per_second"]}


def sigterm(args, data: Path, root: Path, engine: str, batch: int) -> Dict[str, float]:
    out = root / f"{engine}-b{batch}-sigterm"
    console = root / f"{engine}-sigterm.txt"
    proc = subprocess.Popen(command(args, data, out, engine, batch), cwd=root,
                            env=environment(args.threads), stdout=open(console, "w"),
                            stderr=subprocess.STDOUT)
    while proc.poll() is None and "engine ready" not in console.read_text():
        time.sleep(0.1)
    time.sleep(args.sigterm_after)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    took = time.perf_counter() - sent
    last = console.read_text().strip().splitlines()[-1]
    kept = re.search(r"kept: (\d+) conversations", last)
    return {"seconds_to_exit": took, "status": code, "kept": int(kept.group(1)) if kept else -1,
            "last_line": last}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", type=Path, default=None, help="default: bench/smollm2.py's folder")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--batch-sizes", default="1,16", help="engine=hf's regenerate.batch_size values")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--sigterm-after", type=float, default=None)
    p.add_argument("--no-rates", action="store_true", help="only the SIGTERM runs")
    p.add_argument("--set", nargs="*", default=[], help="more overrides for every run "
                   "(e.g. regenerate.turns=last)")
    args = p.parse_args()
    if args.verifier is None:
        sys.path.insert(0, str(Path(__file__).parent))
        import smollm2

        args.verifier = smollm2.default_folder()
    root = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    data = data_file(root, args.conversations)
    rows = []
    for engine in [] if args.no_rates else args.engines.split(","):
        for batch in ([int(b) for b in args.batch_sizes.split(",")] if engine == "hf" else [0]):
            m = measure(args, data, root, engine, batch)
            rows.append((engine, batch, m))
            print(f"{engine} batch={batch or '-'}: {m}", file=sys.stderr, flush=True)
    print("| engine | regenerate.batch_size | conversations | replies | new tokens | "
          "conversations/s | tokens/s | generation s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for engine, batch, m in rows:
        print(f"| {engine} | {batch or '-'} | {m['conversations']} | {m['replies']} | "
              f"{m['new_tokens']} | {m['conv_s']:.3f} | {m['tok_s']:.1f} | {m['seconds']:.1f} | "
              f"{m['wall']:.1f} |")
    if args.sigterm_after is not None:
        for engine in args.engines.split(","):
            batch = max(int(b) for b in args.batch_sizes.split(",")) if engine == "hf" else 0
            s = sigterm(args, data, root, engine, batch)
            print(f"\nSIGTERM {args.sigterm_after:.0f} s after the {engine} engine was ready: "
                  f"exit after {s['seconds_to_exit']:.1f} s, status {s['status']}, "
                  f"{s['kept']} conversations kept\n    {s['last_line']}")


if __name__ == "__main__":
    main()
