"""A 3-point sweep over sample counts shares one extraction; compare reads folders and W&B."""

from __future__ import annotations

import pytest
import json
import subprocess
import sys


@pytest.mark.slow
def test_three_point_sweep_extracts_once_and_compares(cli, store, tmp_path):
    r = cli("-m", "stage=all", "engine=hf", "logger=wandb", "data.num_samples=60,20,40",
            "trainer.max_steps=20", "train.ttt_steps=2", "eval.depth=2")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1
    sweep = sweeps[0]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 3
    jobs = [json.loads(p.read_text()) for p in summaries]
    status = sorted(j["artifacts"]["hidden"]["status"] for j in jobs)
    assert status == ["built", "reused", "reused"]
    assert len({j["artifacts"]["hidden"]["path"] for j in jobs}) == 1
    assert all(j["eval_accepted_length"] and j["acc"]["acc_0"] is not None for j in jobs)

    c = subprocess.run([sys.executable, "-m", "eagle3x.compare", str(sweep)], capture_output=True,
                       text=True, cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    lines = [l for l in c.stdout.splitlines() if l.strip() and not l.startswith("wrote")]
    assert lines[0].split()[0] == "data.num_samples"
    assert [int(l.split()[0]) for l in lines[1:]] == [20, 40, 60]
    assert (sweep / "compare.png").stat().st_size > 1000
    assert (sweep / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The same jobs, read back from their offline W&B runs by group (= the sweep folder name).
    w = subprocess.run([sys.executable, "-m", "eagle3x.compare", sweep.name, "--wandb-dir",
                        str(sweep), "--out", str(tmp_path / "wb")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert w.returncode == 0, w.stderr
    rows = [l for l in w.stdout.splitlines() if l.strip() and not l.startswith("wrote")][1:]
    assert len(rows) == 3
