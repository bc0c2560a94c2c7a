"""A multi-process run (trainer.devices=2, DDP over gloo on the CPU, ranks Lightning starts)
whose rank fails: every rank stops within a bound, the console names the rank and the
cause in one line, and the command it prints resumes from the last checkpoint. SIGTERM to
one rank stops all of them at the same step with a checkpoint. The failure board (a
rank's error, not a death) in a real process."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Tuple

import psutil
import pytest
import torch

from tests.helpers import Cli

STEPS = 24
COMMON = ["stage=train", "engine=hf", "trainer.accelerator=cpu", f"trainer.max_steps={STEPS}",
          "train.ttt_steps=3", "train.warmup_steps=2", "data.num_samples=96", "logger=none"]
TWO = ["trainer.devices=2", "trainer.strategy=ddp", "train.batch_size=2"]
ONE = ["trainer.devices=1", "train.batch_size=4"]
#: What this test holds "every rank stops" to, from the failure to the last process's exit
#: (distributed.WATCH_INTERVAL is 1 s; the rest is the processes' exit on a busy machine).
BOUND_SECONDS = 20


class Runs:
    def __init__(self, root: Path, cache_dir: Path):
        self.root = root
        self.env = {"EAGLE3X_ARTIFACTS": str(root / "artifacts"), "EAGLE3X_CACHE": str(cache_dir),
                    "WANDB_MODE": "offline"}
        for stage in ("prepare", "extract"):
            r = Cli(root)(f"stage={stage}", "engine=hf", "data.num_samples=96", env=self.env)
            assert r.returncode == 0, r.stderr[-3000:]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "eagle3x", *args], cwd=self.root,
                              env=dict(os.environ, **self.env), capture_output=True, text=True,
                              timeout=900)

    def start(self, out: Path, *args: str) -> Tuple[subprocess.Popen, Path]:
        console = out.with_suffix(".txt")
        proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *COMMON, *args,
                                 f"train.output_dir={out}", f"hydra.run.dir={out}-job"],
                                cwd=self.root, env=dict(os.environ, **self.env),
                                stdout=open(console, "w"), stderr=subprocess.STDOUT)
        return proc, console


pytestmark = pytest.mark.slow  # several training processes (their module fixtures)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir, tiny_verifier) -> Runs:
    return Runs(tmp_path_factory.mktemp("ranks"), cache_dir)


def rank_processes(proc: subprocess.Popen, timeout: float = 300) -> List[psutil.Process]:
    """Rank 0 (the command) and the rank Lightning starts (its child), once training runs."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        kids = [c for c in psutil.Process(proc.pid).children()
                if "eagle3x" in " ".join(c.cmdline())]
        if kids:
            return [psutil.Process(proc.pid), kids[0]]
        time.sleep(0.1)
    raise AssertionError("the second rank never started")


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if list((out / "checkpoints").glob("step*.ckpt")):
            return
        time.sleep(0.1)
    raise AssertionError("no step checkpoint before the run ended")


def step_of(out: Path) -> int:
    return torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["global_step"]


def final_state(out: Path) -> dict:
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STEPS
    return {k: v for k, v in ckpt["state_dict"].items() if v.is_floating_point()}


def the_line(console: Path) -> str:
    shown = console.read_text()
    lines = [x for x in shown.splitlines() if x.startswith("eagle3x: ")]
    assert len(lines) == 1 and "Traceback" not in shown, shown[-3000:]
    return lines[0]


def resume(runs: Runs, line: str) -> subprocess.CompletedProcess:
    argv = shlex.split(line.split("continue with: ", 1)[1])
    assert argv[:3] == ["python", "-m", "eagle3x"]
    return runs.run(*argv[3:])


@pytest.fixture(scope="module")
def one_process(runs) -> dict:
    """The same global batch on one process, uninterrupted: what every resumed run ends with."""
    out = runs.root / "one"
    r = runs.run(*COMMON, *ONE, f"train.output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return final_state(out)


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:  # float32; one and two processes sum in another order (tests/stages/test_distributed.py)
        err = (a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-8)
        assert err < 1e-4, (k, float(err))


def test_a_killed_rank_stops_every_rank_and_the_printed_command_resumes(runs, one_process):
    out = runs.root / "killed"
    proc, console = runs.start(out, *TWO)
    rank0, rank1 = rank_processes(proc)
    wait_for_checkpoint(proc, out)
    rank1.send_signal(signal.SIGKILL)  # what the kernel's out-of-memory killer does
    t0 = time.time()
    proc.wait(BOUND_SECONDS + 60)
    took = time.time() - t0
    assert took < BOUND_SECONDS, took
    assert proc.returncode == 1
    assert not rank0.is_running() and not rank1.is_running()
    line = the_line(console)
    kept = out / "checkpoints" / "last.ckpt"
    assert line.startswith("eagle3x: train stopped: rank 1 of 2 failed (killed by SIGKILL"), line
    assert f"kept: checkpoint at step {step_of(out)} ({kept})" in line, line
    r = resume(runs, line)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {kept}" in r.stdout + r.stderr
    assert_close(one_process, final_state(out))


def test_sigterm_to_one_rank_stops_all_at_the_same_step_with_a_checkpoint(runs, one_process):
    out = runs.root / "preempted"
    proc, console = runs.start(out, *TWO)
    rank0, rank1 = rank_processes(proc)
    wait_for_checkpoint(proc, out)
    rank1.send_signal(signal.SIGTERM)
    proc.wait(BOUND_SECONDS + 60)
    assert proc.returncode == 128 + signal.SIGTERM
    rank1.wait(BOUND_SECONDS)  # it stops at the same step (it checkpointed with rank 0)
    step = step_of(out)
    line = the_line(console)
    assert line.startswith(f"eagle3x: train stopped by SIGTERM after step {step}; kept: "
                           f"checkpoint at step {step}"), line
    assert f"rank 1 of 2 trained" not in (out.parent / "preempted-job" / "rank1.log").read_text()
    r = resume(runs, line)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(one_process, final_state(out))


WATCHED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from eagle3x import distributed

    watch = distributed.RankWatch(Path(sys.argv[1]), rank=0, world=2, interval=0.2)
    watch.start()
    print("watching", flush=True)
    time.sleep(60)  # a collective that never returns
    print("still here", flush=True)
""")


def test_a_rank_that_fails_with_an_error_tells_the_others_which_stop(tmp_path):
    """The failure board: rank 1 records its error; rank 0, blocked (here: asleep), ends
    its process within the watch interval, naming rank 1 and the error."""
    proc = subprocess.Popen([sys.executable, "-c", WATCHED, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "watching"
    from eagle3x import distributed

    other = distributed.RankWatch(tmp_path, rank=1, world=2)
    t0 = time.time()
    other.failed("HiddenSourceError: online hidden states: the engine failed")
    out, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 5 and proc.returncode == 1
    assert "still here" not in out
    assert "rank 1 of 2 failed (HiddenSourceError: online hidden states: the engine failed)" in err
    board = json.loads((tmp_path / ".ranks" / "failed-rank1.json").read_text())
    assert board["rank"] == 1 and board["pid"] == os.getpid()
