"""Where hidden states come from, side by side: offline, online, server.

    python bench/online.py [--steps 150] [--samples 288] [--engine vllm] [--long 12]

On the embedded default (the tiny verifier, the bundled conversations), each mode in a
fresh artifact store, the same training settings:

  offline   stage=extract, then stage=train (the shards written, then read)
  online    stage=train hidden=online (the datamodule's own engine, nothing stored)
  server    stage=serve in the background, then stage=train hidden=server

Prints per mode: wall time of the training command(s), the time to the first training
step (offline: extraction and the train command's start; online and server: the train
command's start and the engine's or client's, which happens inside the train stage), the
engine's start, the trainer's wait for batches (seconds and share of training), and the
bytes written to the artifact store and the shared folder. The server's own start is
printed apart: it serves every run that follows. Recorded in bench/RESULTS.md.

`--long K`: the longer-sequence case. Each conversation is K consecutive bundled ones
joined into one multi-turn conversation (the next K, cyclically, for the next sample), so
samples are about K times longer (extract.max_seq_len=2047: the tiny verifier has 2048
positions, one left for the token vLLM generates).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def long_conversations(k: int, out: Path) -> Path:
    """The bundled conversations, K consecutive ones joined (system prompts dropped)."""
    from eagle3x.resources import __file__ as res

    convs = [json.loads(x) for x in (Path(res).parent / "sample_conversations.jsonl")
             .read_text().splitlines() if x.strip()]
    with out.open("w") as f:
        for j in range(len(convs)):
            msgs = [m for c in (convs[(j + i) % len(convs)] for i in range(k))
                    for m in c["messages"] if m["role"] != "system"]
            f.write(json.dumps({"id": f"long-{j:04d}", "messages": msgs}) + "\n")
    return out


def run(args: list, env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3x", *args], env=env, cwd=cwd,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--samples", type=int, default=288)
    p.add_argument("--engine", default="vllm")
    p.add_argument("--long", type=int, default=0)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eagle3x-online-"))
    common = [f"engine={a.engine}", "logger=none", f"trainer.max_steps={a.steps}",
              f"data.num_samples={a.samples}"]
    if a.long:
        data = long_conversations(a.long, root / "long.jsonl")
        common += [f"data.path={data}", "extract.max_seq_len=2047"]
    rows = {}
    for mode in ("offline", "online", "server"):
        store, run_dir = root / mode / "store", root / mode / "run"
        env = dict(os.environ, EAGLE3X_ARTIFACTS=str(store))
        args = [*common, f"train.output_dir={run_dir}"]
        server = None
        extra: list = []
        wall = 0.0
        if mode == "offline":
            run(["stage=prepare", *args], env, root)
            wall += run(["stage=extract", *args], env, root)
        else:
            run(["stage=prepare", *args], env, root)
        if mode == "server":
            shared = root / mode / "shared"
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            t0 = time.perf_counter()
            server = subprocess.Popen(
                [sys.executable, "-m", "eagle3x", "stage=serve", *args, f"serve.port={port}",
                 f"hidden.shared_dir={shared}"], env=env, cwd=root, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
            url = ""
            while server.poll() is None and not url.startswith("http://"):
                url = server.stdout.readline().strip()  # log lines come first
            if not url.startswith("http://"):
                sys.exit("stage=serve did not come up")
            serve_start = time.perf_counter() - t0
            extra = ["hidden=server", f"hidden.urls=[{url}]", f"hidden.shared_dir={shared}"]
        elif mode == "online":
            extra = ["hidden=online"]
        try:
            wall += run(["stage=train", *args, *extra], env, root)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
        s = json.loads((run_dir / "train_summary.json").read_text())
        row = {"wall_s": round(wall, 1), "train_s": round(s["train_seconds"], 1),
               "before_training_s": round(wall - s["train_seconds"], 1),
               "store_bytes": du(store), "shared_bytes": du(root / mode / "shared"),
               "val_acc_0": round(s["metrics"].get("val/acc_0", float("nan")), 4)}
        row["first_step_s"] = row["before_training_s"]  # offline: extraction included
        if mode != "offline":  # the engine starts inside the train stage (datamodule setup)
            row.update(engine_start_s=s["hidden_engine_start_seconds"],
                       wait_s=s["hidden_wait_seconds"], wait_fraction=s["hidden_wait_fraction"])
            row["first_step_s"] = round(row["before_training_s"] + row["engine_start_s"], 1)
        if mode == "server":
            row["server_start_s"] = round(serve_start, 1)
        rows[mode] = row
        print(mode, json.dumps(row), flush=True)
    print(f"\n{'mode':8s} {'wall s':>7s} {'first step s':>12s} {'train s':>8s} "
          f"{'wait %':>7s} {'store MB':>9s} {'acc0':>6s}")
    for mode, r in rows.items():
        print(f"{mode:8s} {r['wall_s']:7.1f} {r['first_step_s']:12.1f} {r['train_s']:8.1f} "
              f"{100 * r.get('wait_fraction', 0):7.1f} {r['store_bytes'] / 1e6:9.2f} "
              f"{r['val_acc_0']:6.3f}")


if __name__ == "__main__":
    main()
