"""How long eagle3x takes to refuse a mistaken command, against a bare interpreter start.

    python bench/startup.py [--runs 7]

Prints the median wall time of `python -c pass`, of the refusal of
`python -m eagle3x stage=extract extract.data_path=/x`, their ratio, and confirms that
none of torch / vllm / lightning / transformers was imported on the way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(cmd: list, runs: int) -> tuple:
    times, last = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        last = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), last


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    bare, _ = timed([sys.executable, "-c", "pass"], args.runs)
    refuse, r = timed([sys.executable, "-m", "eagle3x", "stage=extract", "extract.data_path=/x"], args.runs)
    assert r.returncode == 2, r.stderr
    imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "eagle3x", "stage=extract",
                          "extract.data_path=/x"], capture_output=True, text=True).stderr
    heavy = sorted({l.split("|")[-1].strip().split(".")[0] for l in imp.splitlines()
                    if l.startswith("import time:")} & {"torch", "vllm", "lightning", "transformers"})
    print(f"bare python start     {bare * 1000:8.0f} ms")
    print(f"eagle3x refusal       {refuse * 1000:8.0f} ms   (exit 2)")
    print(f"ratio                 {refuse / bare:8.1f} x")
    print(f"heavy imports         {', '.join(heavy) if heavy else 'none'}")


if __name__ == "__main__":
    main()
