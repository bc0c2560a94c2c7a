"""Training on more than one process: Lightning DDP on the CPU (gloo), started through
`python -m eagle3x trainer.devices=2` as a user would, against one process with the same
global batch; resume across a change of the number of processes; a sweep whose jobs each
train on two processes.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.helpers import Cli

STEPS = 12
COMMON = ["stage=train", "engine=hf", "trainer.accelerator=cpu", f"trainer.max_steps={STEPS}",
          "train.ttt_steps=3", "train.warmup_steps=2", "trainer.log_every_n_steps=1",
          "data.num_samples=96"]
ONE = ["trainer.devices=1", "train.batch_size=4", "logger=csv"]
TWO = ["trainer.devices=2", "trainer.strategy=ddp", "train.batch_size=2", "logger=csv"]


class Runs:
    def __init__(self, root: Path, cache_dir: Path):
        self.root = root
        self.env = {"EAGLE3X_ARTIFACTS": str(root / "artifacts"), "EAGLE3X_CACHE": str(cache_dir),
                    "WANDB_MODE": "offline"}
        self.cli = Cli(root)
        for stage in ("prepare", "extract"):
            r = self.run(f"stage={stage}", "engine=hf", "data.num_samples=96")
            assert r.returncode == 0, r.stderr[-3000:]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return self.cli(*args, env=self.env)

    def start(self, *args: str) -> subprocess.Popen:
        """A run in its own process group (the ranks Lightning starts join it)."""
        return subprocess.Popen([sys.executable, "-m", "eagle3x", *args], cwd=self.root,
                                env=dict(os.environ, **self.env), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def train(self, name: str, *args: str) -> Path:
        out = self.root / name
        r = self.run(*COMMON, *args, f"train.output_dir={out}")
        assert r.returncode == 0, r.stderr[-4000:]
        return out

    def killed(self, name: str, *args: str, at: int = 5) -> Path:
        """A run SIGKILLed (every process of it) once step `at` is checkpointed."""
        out = self.root / name
        proc = self.start(*COMMON, *args, f"train.output_dir={out}")
        target = out / "checkpoints" / f"step{at:06d}.ckpt"
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not target.exists():
            time.sleep(0.05)
        assert proc.poll() is None, "training ended before it could be killed"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert not (out / "draft").exists()
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir) -> Runs:
    return Runs(tmp_path_factory.mktemp("ddp"), cache_dir)


@pytest.fixture(scope="module")
def one(runs) -> Path:
    return runs.train("one", *ONE)


#: The two-process run's Hydra job folder: a space and a non-ASCII letter, which the rank
#: Lightning starts must reach unchanged.
JOB = "jobs/run café 2"


@pytest.fixture(scope="module")
def two(runs) -> Path:
    return runs.train("two", *TWO[:-1], "logger=wandb",
                      f"hydra.run.dir='{runs.root / JOB}'")


def logged(run: Path, key: str) -> List[float]:
    rows = list(csv.DictReader(open(next(run.rglob("metrics.csv")))))
    return [float(r[key]) for r in rows if r.get(key)]


def state(run: Path) -> Dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STEPS
    return {k: v for k, v in ckpt["state_dict"].items() if v.is_floating_point()}


def assert_close_states(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:  # float32; only the order of the sums differs between the runs
        err = (a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-8)
        assert err < 1e-4, (k, float(err))


@pytest.mark.slow
def test_two_processes_train_what_one_process_with_the_same_global_batch_trains(one, two):
    wandb_dir = two / "wandb"
    # the W&B run is rank 0's: its metrics are the global batch's (summed over ranks)
    summary = json.loads((two / "train_summary.json").read_text())
    single = json.loads((one / "train_summary.json").read_text())
    for key in ("train/loss", "val/acc_0", "val/loss_0", "val/loss_2", "val/verifier_choice"):
        assert summary["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4), key
    assert len([d for d in wandb_dir.glob("offline-run-*")]) == 1
    assert_close_states(state(one), state(two))


@pytest.mark.slow
def test_the_rank_lightning_starts_runs_the_job_in_its_folder_and_writes_nothing_of_rank_0s(
        one, two, runs):
    job = runs.root / JOB
    text = (job / "rank1.log").read_text()
    assert "rank 1 of 2 trained 12 steps" in text
    assert "summary ->" not in text and "draft ->" not in text
    assert "summary ->" in (job / "eagle3x.log").read_text()
    assert not (job / ".hydra" / "rank1").exists()
    assert sorted(p.name for p in (two / "checkpoints").iterdir())[-1] == "step000012.ckpt"


@pytest.mark.slow
def test_per_step_losses_of_one_and_two_processes_agree(one, runs):
    two_csv = runs.train("two_csv", *TWO)
    a, b = logged(one, "train/loss"), logged(two_csv, "train/loss")
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-5)
    # the gradient each step applies (AdamW and clipping would hide a wrong scale in the
    # weights): the global batch's on both
    ga, gb = logged(one, "train/grad_norm"), logged(two_csv, "train/grad_norm")
    assert len(ga) == len(gb) == STEPS
    assert ga == pytest.approx(gb, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [("two", "one"), ("one", "two")])
def test_a_run_killed_on_one_world_size_resumes_on_another_with_the_same_batches(
        runs, one, before, after):
    sizes = {"one": ONE, "two": TWO}
    run = runs.killed(f"killed_{before}_{after}", *sizes[before])
    resumed = runs.train(run.name, *sizes[after])  # same folder: train.resume=auto
    assert_close_states(state(one), state(resumed))


@pytest.mark.slow
def test_resuming_with_another_global_batch_is_refused_with_the_numbers(runs, one, tmp_path):
    r = runs.run(*COMMON, "trainer.devices=1", "train.batch_size=2", "logger=none",
                 f"train.resume={one / 'checkpoints' / 'last.ckpt'}",
                 f"train.output_dir={tmp_path / 'other'}")
    assert r.returncode == 1
    assert "global batch of 4" in r.stderr and "this run's is 2" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_sweep_whose_jobs_train_on_two_processes_keeps_each_rank_in_its_job(runs):
    r = runs.run("-m", *[c for c in COMMON if not c.startswith("trainer.max_steps")], *TWO,
                 "trainer.max_steps=2", "train.seed=0,1", "hydra.sweep.dir=sweep")
    assert r.returncode == 0, r.stderr[-4000:]
    jobs = sorted(j for j in (runs.root / "sweep").iterdir() if j.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    for j in jobs:
        assert "rank 1 of 2 trained 2 steps" in (j / "rank1.log").read_text()
        assert (j / "draft" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_long_sequence_paths_train_what_the_short_ones_train(runs, one):
    """Blocks of 16 positions and loss chunks of 64, through a real Trainer (packed
    batches, recompute in backward): the draft the default settings train."""
    run = runs.train("blocked", *ONE, "train.attention_block=16", "train.loss_chunk=64")
    assert_close_states(state(one), state(run))


@pytest.mark.slow
def test_two_processes_online_each_make_only_their_own_batches(runs, one):
    """hidden=online on two processes: each rank's engine makes its own micro-batches and
    its share of the held-out samples, none twice, and they train what one process reading
    the extracted shards trains."""
    run = runs.train("two_online", *TWO, "hidden=online")
    summary = json.loads((run / "train_summary.json").read_text())
    made = summary["hidden_samples_made"]
    validations = len(logged(run, "val/acc_0"))
    assert validations >= 2
    # the global batch (4) at every step, and every held-out sample at each validation
    assert sum(made) == STEPS * 4 + validations * summary["val_samples"]
    assert made[0] == made[1]
    # each step trained on the samples one process trains on: the same losses (features
    # made online and extracted offline may round differently to bfloat16 storage; AdamW
    # magnifies that in the weights, not in the losses)
    a, b = logged(one, "train/loss"), logged(run, "train/loss")
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-3)
