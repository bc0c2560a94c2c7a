"""Wall time of a 3-point sweep sharing one extraction, against 3 independent runs.

    python bench/sweep.py [--counts 80,160,320] [--steps 30] [overrides ...]

The sweep is `python -m eagle3x -m stage=all data.num_samples=a,b,c` (one artifact store);
the independent runs are three `stage=all` commands, each with its own empty store, so
each prepares and extracts for itself. Prints both wall times and their ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(args: list, env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3x", *args], env=env, cwd=cwd,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stderr[-3000:])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--counts", default="80,160,320")
    p.add_argument("--steps", type=int, default=30)
    known, extra = p.parse_known_args()
    root = Path(tempfile.mkdtemp(prefix="eagle3x-sweep-bench-"))
    common = ["stage=all", "logger=none", f"trainer.max_steps={known.steps}", *extra]
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(root / "shared"))
    sweep = timed(["-m", *common, f"data.num_samples={known.counts}"], env, root)
    alone = 0.0
    for i, n in enumerate(known.counts.split(",")):
        env_i = dict(os.environ, EAGLE3X_ARTIFACTS=str(root / f"alone{i}"))
        alone += timed([*common, f"data.num_samples={n}"], env_i, root)
    print(f"sweep (shared extraction)   {sweep:7.1f} s")
    print(f"3 independent runs          {alone:7.1f} s")
    print(f"ratio independent / sweep   {alone / sweep:7.2f} x")


if __name__ == "__main__":
    main()
