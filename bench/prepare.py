"""Prepare at scale: conversations/s and peak memory at 10K / 100K / 1M conversations.

    python bench/prepare.py [--sizes 10000,100000,1000000] [--num-proc 2] [--verifier tiny|qwen3]
                            [--baseline /path/to/older/eagle3x] [--keep DIR]

Writes synthetic conversation files (seeded; ~2 KB a conversation: multi-turn chats, tool
calls with their results, reasoning, system prompts; 1M is ~2 GB), then runs
``python -m eagle3x stage=prepare`` on each as a user would, in a fresh artifact store,
and samples the resident memory of the whole process tree (the job and its tokenizer
processes, /proc, every 0.2 s). Prints per size: seconds, conversations/s, tokens,
peak RSS of the tree and of the largest process, and the ratio of each to the smallest
size's (flat memory: a ratio near 1 while the file grows 100x). With --baseline the same
command also runs on a file of the same size without tool calls (which an older eagle3x
refuses), with this code and with PYTHONPATH at the older checkout, side by side (sizes
<= 100K: the older code holds every conversation in memory). A second run of each size, reusing the prepared data,
shows what startup costs then (the input's facts are remembered, the file is not read).
--verifier qwen3 prepares with the Qwen3 template on a zoo verifier (split_turns on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the model reads tokens and writes answers while a draft guesses the next few so "
         "the verifier can check them at once which saves time when guesses are right often "
         "weather city temperature forecast tool result query search file path error fix "
         "please explain why how what when step first then finally because").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversation(rng: random.Random, i: int) -> dict:
    """One synthetic conversation of about 2 KB, of one of three kinds."""
    kind = i % 3
    msgs = [{"role": "system", "content": sentence(rng, 12)}]
    if kind == 0:  # a multi-turn chat
        for _ in range(3):
            msgs.append({"role": "user", "content": sentence(rng, 25)})
            msgs.append({"role": "assistant", "content": sentence(rng, 70)})
        return {"messages": msgs}
    if kind == 1:  # a tool call, its result, the answer, with reasoning
        city = rng.choice(["Paris", "Oslo", "Lima", "Rome"])
        msgs += [{"role": "user", "content": sentence(rng, 30) + f" {city}?"},
                 {"role": "assistant", "content": "", "reasoning_content": sentence(rng, 60),
                  "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                      "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}",
                  "content": json.dumps({"city": city, "temp": rng.randint(-10, 35),
                                         "note": sentence(rng, 20)})},
                 {"role": "assistant", "reasoning_content": sentence(rng, 40),
                  "content": sentence(rng, 60)}]
        return {"tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather now.", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}],
            "messages": msgs}
    msgs += [{"role": "user", "content": sentence(rng, 40)},  # a long reasoned answer
             {"role": "assistant", "reasoning_content": sentence(rng, 110),
              "content": sentence(rng, 110)}]
    return {"messages": msgs}


def write_data(path: Path, n: int, plain: bool = False) -> None:
    """n conversations; `plain`: without tool calls (what an older eagle3x can read)."""
    rng = random.Random(n)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps(conversation(rng, i if not plain or i % 3 != 1 else i + 1))
                    + "\n")


def tree_rss(root: int) -> tuple:
    """(sum of RSS bytes over `root` and its descendants, largest single RSS)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, todo = {root}, [root]
    while todo:
        p = todo.pop()
        for c, pp in parents.items():
            if pp == p and c not in tree:
                tree.add(c)
                todo.append(c)
    total = biggest = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1]) * 1024
                        total += kb
                        biggest = max(biggest, kb)
        except OSError:
            continue
    return total, biggest


def run(cmd: list, env: dict, cwd: Path) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would block it
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        peak = biggest = 0
        while proc.poll() is None:
            total, big = tree_rss(proc.pid)
            peak, biggest = max(peak, total), max(biggest, big)
            time.sleep(0.2)
        seconds = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    tokens = None
    for line in out.splitlines():
        if "prepared " in line and " samples, " in line:
            tokens = int(line.split(" samples, ")[1].split()[0])
    return {"seconds": seconds, "peak_rss": peak, "largest_rss": biggest, "tokens": tokens,
            "log": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--verifier", choices=["tiny", "qwen3"], default="tiny")
    ap.add_argument("--baseline", help="an older eagle3x checkout to run side by side")
    ap.add_argument("--keep", help="keep the data files here (reused when present)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="eagle3x-bench-prepare-"))
    data_dir = Path(args.keep) if args.keep else work
    data_dir.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get("EAGLE3X_CACHE", str(Path.home() / ".cache" / "eagle3x"))
    extra = []
    if args.verifier == "qwen3":
        sys.path.insert(0, str(REPO))
        from eagle3x.testing import chat_zoo

        path = chat_zoo.build_verifier("qwen3", cache)
        extra = ["verifier=local", f"verifier.path={path}", "experiment=tiny",
                 "data.split_turns=true"]
    rows = []
    try:
        for n in sizes:
            runs = [("eagle3x", str(REPO), "mixed")]
            if args.baseline and n <= 100000:
                runs += [("eagle3x", str(REPO), "plain"), ("baseline", args.baseline, "plain")]
            for label, code, kind in runs:
                data = data_dir / f"{kind}-{n}.jsonl"
                if not data.exists():
                    t0 = time.perf_counter()
                    write_data(data, n, plain=kind == "plain")
                    print(f"wrote {n} {kind} conversations, {data.stat().st_size / 2**20:.0f} MiB "
                          f"in {time.perf_counter() - t0:.0f}s", flush=True)
                cmd = [sys.executable, "-m", "eagle3x", "stage=prepare", "data=jsonl",
                       f"data.path={data}", "extract.max_seq_len=2047", *extra]
                if label == "eagle3x":
                    cmd += [f"data.num_proc={args.num_proc}", f"data.chunk_size={args.chunk_size}"]
                store = work / f"art-{label}-{kind}-{n}"
                env = dict(os.environ, PYTHONPATH=code, EAGLE3X_ARTIFACTS=str(store),
                           EAGLE3X_CACHE=cache, WANDB_MODE="offline")
                r = run(cmd, env, work)
                again = run(cmd, env, work)  # reuses the prepared data
                row = {"size": n, "code": label, "data": kind, "bytes": data.stat().st_size, **r,
                       "reuse_seconds": again["seconds"]}
                row.pop("log")
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'size':>8} {'code':>9} {'data':>6} {'MiB':>6} {'seconds':>8} {'conv/s':>8} "
          f"{'tokens':>11} {'peak RSS tree':>14} {'largest':>9} {'x smallest':>10} {'rerun s':>8}")
    first = {}
    for r in rows:
        base = first.setdefault((r["code"], r["data"]), r)
        print(f"{r['size']:>8} {r['code']:>9} {r['data']:>6} {r['bytes'] / 2**20:>6.0f} "
              f"{r['seconds']:>8.1f} "
              f"{r['size'] / r['seconds']:>8.0f} {r['tokens'] or 0:>11} "
              f"{r['peak_rss'] / 2**20:>10.0f} MiB {r['largest_rss'] / 2**20:>5.0f} MiB "
              f"{r['peak_rss'] / base['peak_rss']:>9.2f}x {r['reuse_seconds']:>8.1f}")


if __name__ == "__main__":
    main()
