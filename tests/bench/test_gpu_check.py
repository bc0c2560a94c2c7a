"""The prepared GPU check runs end to end on the CPU with --smoke, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_writes_every_figure(tmp_path, cache_dir):
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "EAGLE3X_CACHE": str(cache_dir)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    failed = {k: v.get("error") for k, v in res["stages"].items() if not v["ok"]}
    assert not failed, failed
    assert res["matmul_flops"] > 0
    hf = res["extract"]["hf"]
    # 3 aux + 1 last hidden state of 128 bf16 values, plus id, mask and header overhead.
    assert hf["tokens_per_second"] > 0 and 4 * 128 * 2 < hf["bytes_per_token"] < 4 * 128 * 2 + 64
    assert res["train"]["tokens_per_second"] > 0 and 0 < res["train"]["mfu"] < 1
    assert res["eval"]["positions"] > 0
