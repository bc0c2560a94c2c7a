"""Hidden-state extraction speed: engine=vllm against engine=hf on the same model and data.

    python bench/extract.py [--samples 320] [overrides ...]

Runs `python -m eagle3x stage=extract` once per engine into fresh folders (same prepared
data), and prints the extraction throughput (tokens/s of the extraction loop, engine
start excluded), the wall time including the engine start, their ratio, and the bytes
per token on disk next to the formula for the storage format (``extract.aux_format``,
``extract.teacher``: data/compact.py) and what it gives at real hidden sizes. Extra
arguments are passed on as overrides (e.g. a real verifier, a compact format).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINE = re.compile(r"extracted (\d+) new samples \((\d+) tokens, (\d+) tok/s\) in ([\d.]+)s "
                  r"\(\+([\d.]+)s engine start\)")


def run(args: list, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "eagle3x", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr[-3000:]}")
    return r


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=320)
    p.add_argument("--batch", type=int, default=16, help="extract.batch_size for hf")
    p.add_argument("--vllm-batch", type=int, default=128, help="extract.batch_size for vllm")
    known, extra = p.parse_known_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3x-bench-"))
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(tmp / "artifacts"))
    common = [f"data.num_samples={known.samples}", *extra]
    batch = {"vllm": known.vllm_batch, "hf": known.batch}
    run(["stage=prepare", *common], env)
    results = {}
    for engine in ("vllm", "hf"):
        out = tmp / engine
        t0 = time.perf_counter()
        r = run(["stage=extract", f"engine={engine}", f"extract.output_dir={out}",
                 f"extract.batch_size={batch[engine]}", *common], env)
        wall = time.perf_counter() - t0
        m = LINE.search(r.stdout + r.stderr)
        manifest = json.loads((out / "manifest.json").read_text())
        tokens = sum(s["tokens"] for s in manifest["shards"])
        size = sum(s["bytes"] for s in manifest["shards"])
        results[engine] = {"tok_s": int(m.group(3)), "loop_s": float(m.group(4)),
                           "start_s": float(m.group(5)), "wall_s": wall,
                           "tokens": tokens, "bytes_per_token": size / tokens,
                           "format": manifest.get("format"), "hidden_size": manifest["hidden_size"],
                           "dtype": manifest["dtype"]}
    for e, r in results.items():
        print(f"{e:5s} {r['tok_s']:9d} tok/s  loop {r['loop_s']:6.1f}s  start {r['start_s']:5.1f}s  "
              f"wall {r['wall_s']:6.1f}s  "
              f"{r['tokens']} tokens  {r['bytes_per_token']:.0f} bytes/token")
    print(f"ratio vllm/hf tokens/s: {results['vllm']['tok_s'] / results['hf']['tok_s']:.2f}")
    from eagle3x.data.compact import baseline_bytes_per_token, bytes_per_token

    r = results["hf"]
    fmt = r["format"] or {"aux": "native", "teacher": "hidden"}
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[r["dtype"]]
    print(f"format {fmt} in {r['dtype']}: formula {bytes_per_token(r['hidden_size'], size, fmt)} "
          f"bytes/token at H={r['hidden_size']}; at H=4096 / 8192 / 7168: " + ", ".join(
              f"{bytes_per_token(h, size, fmt)} ({bytes_per_token(h, size, fmt) / baseline_bytes_per_token(h):.3f}x bf16)"
              for h in (4096, 8192, 7168)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
