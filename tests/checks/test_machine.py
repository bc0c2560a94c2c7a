"""Startup refusals of settings the machine or a library would reject only after launch:
devices, memory vLLM reserves, context length, heads per rank, Lightning devices, W&B."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from eagle3x.checks import machine
from eagle3x.verifier import verifier_context
from tests.config.test_refusals import refused

NO_GPU = {"EAGLE3X_GPU_COUNT": "0"}


def passes(cli, *args: str, key: str, env=None) -> None:
    """The command line is not refused for `key` (other problems, e.g. missing data, may
    remain). Validation only, in-process: nothing is run."""
    result = cli.refusal(list(args), env)
    assert result is None or f"x {key}" not in result.stderr, result.stderr


def test_hf_on_cuda_without_a_gpu(cli):
    refused(cli("stage=extract", "engine=hf", "engine.device=cuda", env=NO_GPU),
            "engine.device=cuda   (command line)", "no CUDA GPU", "engine.device=cpu")
    passes(cli, "stage=extract", "engine=hf", "engine.device=auto", key="engine.device", env=NO_GPU)


def test_vllm_cpu_memory_share_that_is_not_free(cli):
    mem = machine.cpu_memory()
    assert mem is not None and 0 < mem.available <= mem.total
    err = refused(cli("stage=extract", "engine.gpu_memory_utilization=1.0", env=NO_GPU),
                  "x engine.gpu_memory_utilization=1.0", "is free now (CPU build)")
    fits = float(re.search(r"engine.gpu_memory_utilization=([0-9.]+) or lower", err).group(1))
    assert 0 < fits * mem.total <= mem.available  # the suggested share would start
    passes(cli, "stage=extract", f"engine.gpu_memory_utilization={fits}",
           key="engine.gpu_memory_utilization", env=NO_GPU)


def test_live_eval_memory_is_checked_too(cli):
    refused(cli("stage=eval", "eval.live=true", "engine.gpu_memory_utilization=1.0", env=NO_GPU),
            "x engine.gpu_memory_utilization=1.0")


def fake_nvidia_smi(folder: Path, rows: str) -> dict:
    """An nvidia-smi answering the memory query (GPUs cannot exist here); the rule it is
    checked against is vLLM's (vllm/v1/worker/utils.py, request_memory)."""
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "EAGLE3X_GPU_COUNT": "2",
            "CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.mark.slow
def test_gpu_memory_share_checked_on_every_rank(cli, tmp_path):
    env = fake_nvidia_smi(tmp_path, "0, 81920, 81000\\n1, 81920, 40000\\n")
    refused(cli("stage=extract", "engine.tensor_parallel_size=2",
                "engine.gpu_memory_utilization=0.9", env=env),
            "GPU 1's 80.0 GB", "is free now (GPU build)", "engine.gpu_memory_utilization=0.45")
    passes(cli, "stage=extract", "engine.tensor_parallel_size=2",
               "engine.gpu_memory_utilization=0.45", key="engine.gpu_memory_utilization", env=env)
    # rank 0 alone fits 0.9
    passes(cli, "stage=extract", "engine.gpu_memory_utilization=0.9",
           key="engine.gpu_memory_utilization", env=env)


def test_samples_longer_than_the_verifier_context(cli):
    refused(cli("stage=extract", "extract.max_seq_len=100000"),
            "x extract.max_seq_len=100000", "context of 2048 positions", "max_seq_len=2047")
    refused(cli("stage=prepare", "engine=hf", "extract.max_seq_len=2049"), "max_seq_len=2048 or less")
    passes(cli, "stage=prepare", "engine=hf", "extract.max_seq_len=2048", key="extract.max_seq_len")


@pytest.mark.parametrize("raw,context", [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),  # the smallest key
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}, 8192),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"max_position_embeddings": 163840, "rope_scaling": {"type": "yarn", "factor": 40}}, 163840),
    ({"text_config": {"max_position_embeddings": 32768}}, 32768),
    ({"hidden_size": 8}, None),
])
def test_verifier_context_follows_vllms_rule(raw, context):
    assert verifier_context(raw) == context


def test_heads_must_divide_into_tensor_parallel_ranks(cli):
    refused(cli("stage=extract", "engine.tensor_parallel_size=3", env={"EAGLE3X_GPU_COUNT": "4"}),
            "2 attention heads do not divide into 3 ranks")
    passes(cli, "stage=extract", "engine.tensor_parallel_size=2",
           key="engine.tensor_parallel_size", env={"EAGLE3X_GPU_COUNT": "4"})


def test_lightning_accelerator_and_devices_this_machine_lacks(cli):
    refused(cli("stage=train", "trainer.accelerator=gpu", env=NO_GPU),
            "x trainer.accelerator=gpu   (command line)", "no CUDA GPU")
    refused(cli("stage=train", "trainer.accelerator=gpu", "trainer.devices=4",
                env={"EAGLE3X_GPU_COUNT": "2"}), "4 devices, but this machine shows 2 GPU(s)")


def test_fp16_on_the_cpu_is_announced_not_refused(store, tiny_verifier, monkeypatch):
    from eagle3x.__main__ import validate

    monkeypatch.setenv("EAGLE3X_GPU_COUNT", "0")
    notes: list = []
    assert validate(["stage=train", "trainer.precision=16-mixed"], notes) == []
    assert any("bf16-mixed instead" in n for n in notes)


def test_wandb_online_without_an_api_key(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    refused(cli("stage=train", "logger.mode=online"), "no W&B API key", "wandb login")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    passes(cli, "stage=train", "logger.mode=online", key="logger.mode")
    (tmp_path / ".netrc").unlink()
    passes(cli, "stage=train", "logger.mode=online", key="logger.mode", env={"WANDB_API_KEY": "x" * 40})


def test_an_empty_wandb_mode_is_traced_to_the_environment(cli):
    refused(cli("stage=train", env={"WANDB_MODE": ""}),
            "logger.mode=   (from environment variable WANDB_MODE='')")


@pytest.mark.parametrize("override,key", [("extract.batch_size=${oc.env:EAGLE3X_TEST_X}", "extract.batch_size"),
                                          ("stage=${oc.env:EAGLE3X_TEST_X}", "stage")])
def test_an_interpolation_its_field_cannot_hold_is_a_problem_naming_the_key(override, key,
                                                                            monkeypatch):
    """Found by the override fuzzer: an environment variable whose text an int or enum field
    refuses crashed the validator instead of being reported."""
    from eagle3x.__main__ import validate

    monkeypatch.setenv("EAGLE3X_TEST_X", "not-a-number")
    problems = validate([override] if key == "stage" else ["stage=train", override])
    assert [p.key for p in problems] == [key]
    assert "EAGLE3X_TEST_X" in problems[0].render() and "not-a-number" in problems[0].render()
