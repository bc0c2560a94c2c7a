"""The prepared GPU check runs end to end on the CPU with --smoke, so it cannot rot: every part
of the json is there, and the sample arithmetic is the one the GPU run uses."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_figure(tmp_path, cache_dir):
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "EAGLE3X_CACHE": str(cache_dir)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    failed = {k: v.get("error") or v.get("timeout") or v.get("skipped")
              for k, v in res["parts"].items() if not v["ok"]}
    assert not failed, failed
    assert res["matmul_flops"] > 0
    # the fused attention against the reference, in the check's own terms
    check = res["parts"]["check"]["result"]
    assert check["ok"] and check["fused"]["grad_rel_err_max"] < 1e-4
    for length in ("64", "128", "256"):
        step = res["steps"]["eagle3x"][length]
        assert step["tokens_per_second"] > 0 and step["first_step_s"] > 0
        assert step["attention"] == "fused"
    if "peer_missing" not in res:  # speculators installed (bench/peer_train.py says how)
        assert res["steps"]["peer"]["64"]["tokens_per_second"] > 0
        assert res["eagle3x_over_peer"]["64"]["tokens_per_second"] > 0
    # the embedded default's stage=all and the bigger verifier's end-to-end run
    assert res["demo"]["steps"] == 3 and res["demo"]["eval_accepted_length"] > 1
    split = res["e2e_split"]
    assert split["train"] + split["holdout"] == 320  # all the bundled conversations
    assert res["e2e_train"]["train_samples"] == split["train"]
    ratio = res["e2e_ratio"]
    assert ratio["loop_tokens_per_second"] > 0 and 0 < ratio["loop_mfu"] < 1
    assert ratio["isolated_tokens_per_second"] > 0 and 0 < ratio["trained_fraction"] < 1
