"""vLLM's start on this machine, with and without torch.compile, phase by phase.

    python bench/engine_start.py [--verifier PATH] [--modes eager,compile-cold,compile-warm]

Each mode is one `python -m eagle3x stage=extract` on 16 samples (a fresh artifact store;
the verifier's own chat template) whose engine start is read from its console line
"engine vllm ready in Xs (phase Ys, ...)" (eagle3x.engines.watch.StartWatch, which reads
vLLM's log). compile-cold gives vLLM an empty compile cache (VLLM_CACHE_ROOT), compile-warm
the cache the cold run filled; eager is engine.enforce_eager=true; eager-kv1 is eager with
a KV cache of 1 GiB given explicitly (VLLM_CPU_KVCACHE_SPACE=1, vLLM's CPU build) in place
of the share engine.gpu_memory_utilization=0.25 sizes. Prints one json object.
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


def start(verifier: str, root: Path, cache: Path, eager: bool, kv_gib: int = 0) -> dict:
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(root / f"art-{time.time_ns()}"),
               VLLM_CACHE_ROOT=str(cache))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if kv_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    data = ["data.num_samples=8", "data.holdout_samples=8", "extract.max_seq_len=512"]
    if verifier != "tiny":
        data += ["verifier=local", f"verifier.path={verifier}"]
    r = subprocess.run([sys.executable, "-m", "eagle3x", "stage=prepare", *data], cwd=root,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3x", "stage=extract", *data, "engine=vllm",
                        f"engine.enforce_eager={str(eager).lower()}",
                        "engine.gpu_memory_utilization=0.25"], cwd=root, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"engine vllm ready in ([\d.]+)s(?: \((.*)\))?", r.stdout + r.stderr)
    phases = {}
    for part in (m.group(2) or "").split(", "):
        if part:
            name, _, secs = part.rpartition(" ")
            phases[name] = float(secs.rstrip("s"))
    shown = [x.split(" - ", 1)[-1] for x in (r.stdout + r.stderr).splitlines()
             if "engine vllm" in x]
    return {"ready_seconds": float(m.group(1)), "phases": phases, "console": shown,
            "command_seconds": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier", default="tiny")
    ap.add_argument("--modes", default="eager,compile-cold,compile-warm")
    a = ap.parse_args()
    out = {"verifier": a.verifier, "cpus": os.cpu_count(),
           "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp), Path(tmp) / "vllm-cache"
        for mode in a.modes.split(","):
            out[mode] = start(a.verifier, root, cache, eager=mode.startswith("eager"),
                              kv_gib=1 if mode == "eager-kv1" else 0)
            print(mode, out[mode]["ready_seconds"], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
