"""Data-parallel extraction: several workers, one folder (engine=hf, real processes).

Workers run as `python -m eagle3x` processes: through Hydra's joblib launcher as a user
types it, or one by one to kill, rerun and race them. The result is always compared
tensor for tensor with a one-process extraction of the same samples.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3x.data.extraction import part_ranges
from eagle3x.data.shards import ShardReader
from eagle3x.distributed import extract_worker
from tests.stages.test_extract import all_tensors, manifest, prepared, prepared_store  # noqa: F401

KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
# 32 held out + 64 training samples of the bundled conversations: parts 0..47, 48..95.
TOTAL = 96
PARTS = part_ranges(0, TOTAL, 2)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every extraction here (reference, workers, their joblib children) computes in one
    thread: joblib's loky workers limit themselves to one on a 2-core machine, and float32
    results compared bit for bit must come from the same arithmetic (a reduction split
    over two threads can round differently)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def extract_cmd(out: Path, *extra: str) -> list:
    return [sys.executable, "-m", "eagle3x", "stage=extract", "engine=hf", "extract.batch_size=1",
            "extract.shard_tokens=800", "extract.dtype=float32", "data.num_samples=64", f"extract.output_dir={out}",
            *extra]


def run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def assert_same_as(folder: Path, reference: Path) -> None:
    a, b = all_tensors(folder), all_tensors(reference)
    for k in KEYS:
        assert torch.equal(a[k], b[k]), k


def identity(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in folder.rglob("shard-*.safetensors")}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reference") / "one"


@pytest.fixture
def reference(cli, prepared, reference_dir):  # noqa: F811
    """The one-process extraction every multi-worker result must equal (made once: every
    test's store holds the same prepared data)."""
    if not (reference_dir / "manifest.json").exists():
        run(extract_cmd(reference_dir), cli.cwd)
    return reference_dir


def test_ranges_are_contiguous_cover_everything_and_differ_by_at_most_one():
    for base, target, n in [(0, 320, 2), (7, 100, 3), (0, 5, 8), (40, 40, 2)]:
        r = part_ranges(base, target, n)
        assert r[0][0] == base and r[-1][1] == target and len(r) == n
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
        sizes = [e - s for s, e in r]
        assert max(sizes) - min(sizes) <= 1


def test_the_worker_index_comes_from_the_setting_then_slurm_then_torchrun():
    assert extract_worker(4, 2, {"SLURM_PROCID": "1"}) == (2, "extract.worker")
    assert extract_worker(4, None, {"SLURM_PROCID": "3", "RANK": "0"})[0] == 3
    assert extract_worker(4, None, {"RANK": "1"}) == (1, "environment variable RANK")
    assert extract_worker(1, None, {}) == (0, "single worker")
    for env, worker in [({}, None), ({"RANK": "4"}, None), ({}, 5), ({"RANK": "x"}, None)]:
        with pytest.raises(ValueError):
            extract_worker(4, worker, env)


def test_a_part_whose_worker_still_holds_it_is_joined_by_that_worker_with_its_run(tmp_path):
    """The join waits for a part whose samples are all written while its worker still holds
    the part's lock (it records its run after its last shard): joined then, the manifest
    lost that worker's run (a full-suite run met it once). The worker joins after it."""
    from filelock import FileLock

    from eagle3x import artifacts
    from eagle3x.data.extraction import _join, part_folder

    out = tmp_path / "hidden"
    r = {"parts": PARTS, "workers": 2, "base": 0, "target": TOTAL}
    for i, (a, b) in enumerate(PARTS):
        pm = artifacts.new_manifest("hidden-part", {}, "fp", shards=[], samples=b - a,
                                    first_sample=a, end=b, runs=[{"worker": i}])
        part_folder(out, a, b).mkdir(parents=True)
        artifacts.write_json_atomic(part_folder(out, a, b) / artifacts.MANIFEST, pm)
    m = artifacts.new_manifest("hidden", {}, "fp", shards=[], samples=0)
    held = FileLock(str(part_folder(out, *PARTS[0])) + ".lock")  # worker 0, still writing
    held.acquire()
    try:
        assert not _join(out, dict(m), r)
        assert not (out / artifacts.MANIFEST).exists()
    finally:
        held.release()
    assert _join(out, m, r)
    joined = manifest(out)
    assert joined["samples"] == TOTAL
    assert [run["worker"] for run in joined["runs"]] == [0, 1]


@pytest.mark.slow
def test_joblib_workers_give_the_one_process_extraction(cli, reference, tmp_path):
    out = tmp_path / "many"
    cmd = extract_cmd(out, "extract.workers=2", "extract.worker=0,1", "hydra/launcher=joblib")
    r = run([cmd[0], cmd[1], cmd[2], "-m", *cmd[3:]], cli.cwd)
    assert "joined 2 parts of 2 workers" in r.stdout + r.stderr
    m = manifest(out)
    assert m["samples"] == manifest(reference)["samples"] == TOTAL
    assert all(s["name"].startswith("parts/") for s in m["shards"])
    assert [s["first_sample"] for s in m["shards"]] == sorted(s["first_sample"] for s in m["shards"])
    assert {run["part"] for run in m["runs"]} == {f"parts/{a:010d}-{b:010d}" for a, b in PARTS}
    assert not (out / "round.json").exists()
    ShardReader(out, verify="sha256")
    assert_same_as(out, reference)


@pytest.mark.slow
def test_a_killed_worker_rerun_alone_redoes_nothing_finished(cli, reference, tmp_path):
    out = tmp_path / "h"

    def worker(i: int) -> list:
        return extract_cmd(out, "extract.workers=2", f"extract.worker={i}")

    r = run(worker(0), cli.cwd)
    assert "waiting for the other workers" in r.stdout + r.stderr
    assert manifest(out)["samples"] == 0 and (out / "round.json").exists()
    part1 = out / "parts" / f"{PARTS[1][0]:010d}-{PARTS[1][1]:010d}"
    proc = subprocess.Popen(worker(1), cwd=cli.cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(manifest(part1)["shards"]) >= 2:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    assert proc.poll() is None, "worker 1 finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    before = identity(out)
    listed = {f"parts/{part1.name}/{s['name']}" for s in manifest(part1)["shards"]}
    assert listed and manifest(out)["samples"] == 0  # nothing joined while a part is missing

    # A worker that disagrees with the round under way is refused at startup.
    other = cli("stage=extract", "engine=hf", "extract.dtype=float32", f"extract.output_dir={out}",
                "data.num_samples=64", "extract.workers=3", "extract.worker=1")
    assert other.returncode == 2 and "round.json" in other.stderr
    assert "extract.workers=2" in other.stderr

    r = run(worker(1), cli.cwd)
    assert "all parts joined" in r.stdout + r.stderr
    after = identity(out)
    for name in listed | {n for n in before if n.startswith(f"parts/{0:010d}")}:
        assert after[name] == before[name], f"{name} was rewritten"
    assert manifest(out)["samples"] == TOTAL and not (out / "round.json").exists()
    assert_same_as(out, reference)


@pytest.mark.slow
def test_training_waits_for_a_running_worker_and_finishes_the_round(cli, reference, tmp_path):
    out = tmp_path / "h"
    part0 = out / "parts" / f"{PARTS[0][0]:010d}-{PARTS[0][1]:010d}"
    w0 = subprocess.Popen(extract_cmd(out, "extract.workers=2", "extract.worker=0"),
                          cwd=cli.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and w0.poll() is None:
        try:
            if manifest(part0)["shards"]:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    assert w0.poll() is None, "worker 0 finished before training started"
    w0.send_signal(signal.SIGSTOP)  # a worker still running (slow GPU, busy node)
    # Worker 1 never runs: the training command takes its part over, and waits for part 0.
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log_file:
        train = subprocess.Popen(["stage=train" if a == "stage=extract" else a
                                  for a in extract_cmd(out)] + ["trainer.max_steps=2", "logger=none"],
                                 cwd=cli.cwd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and "waiting for it" not in log_path.read_text():
            assert train.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(2)
        assert train.poll() is None, "training went on while a worker was extracting"
        assert not (out / "round.json").exists() or manifest(out)["samples"] == 0
    finally:
        w0.send_signal(signal.SIGCONT)
    assert train.wait(300) == 0, log_path.read_text()[-3000:]
    w0_out = w0.communicate(timeout=300)[0]
    assert w0.returncode == 0, w0_out[-3000:]
    log = log_path.read_text()
    assert f"another process (worker 0 of 2) is extracting samples 0..{PARTS[0][1] - 1}" in log
    assert "worker 1 (taken over)" in log and "trained 2 steps" in log
    assert len(manifest(part0)["runs"]) == 1, "part 0 extracted twice"
    assert manifest(out)["samples"] == TOTAL and not (out / "round.json").exists()
    assert_same_as(out, reference)


def test_workers_run_as_stage_extract_and_need_an_index(cli, prepared):  # noqa: F811
    r = cli("stage=train", "engine=hf", "extract.workers=2", "extract.worker=0")
    assert r.returncode == 2 and "runs as stage=extract" in r.stderr
    r = cli("stage=extract", "engine=hf", "extract.workers=2", env={"SLURM_PROCID": "", "RANK": ""})
    assert r.returncode == 2 and "extract.worker" in r.stderr and "SLURM_PROCID" in r.stderr
    r = cli("stage=extract", "engine=hf", "extract.workers=2", "extract.worker=2")
    assert r.returncode == 2 and "not in 0..1" in r.stderr


def test_a_round_joined_but_not_cleaned_up_is_recognised(tmp_path):
    from eagle3x.data.extraction import pending_round

    (tmp_path / "round.json").write_text(json.dumps({"base": 0, "target": 96, "workers": 2,
                                                     "parts": PARTS}))
    assert pending_round(tmp_path, {"samples": 0})["workers"] == 2  # under way
    assert pending_round(tmp_path, {"samples": 96}) is None  # joined, then cut off
    assert not (tmp_path / "round.json").exists()


@pytest.mark.slow
def test_a_run_that_needs_only_the_joined_prefix_does_not_wait_for_a_round(cli, prepared,  # noqa: F811
                                                                           tmp_path):
    out = tmp_path / "h"
    small = [a if a != "data.num_samples=64" else "data.num_samples=16" for a in extract_cmd(out)]
    run(small, cli.cwd)  # samples 0..47
    r = run(extract_cmd(out, "extract.workers=2", "extract.worker=0"), cli.cwd)  # 48..71 of 48..95
    assert "waiting for the other workers" in r.stdout + r.stderr
    r = run(small, cli.cwd)
    assert "which this run does not read" in r.stdout + r.stderr
    assert manifest(out)["samples"] == 48 and (out / "round.json").exists()
