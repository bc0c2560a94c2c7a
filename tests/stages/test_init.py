"""draft.init end to end on the tiny verifier: a trained draft exported in several formats,
converted by stage=export without training, fine-tuned from each format with the same
weights loaded, its vocabulary kept (or re-mapped by token id), and a killed warm start
resuming from its checkpoint rather than from the published draft."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import environment, plan_for
from tests.helpers import TrainedRun
from tests.stages.test_train import _assert_same_training

#: Every test here starts an engine or a process (tests/conftest.py's quick-loop guard).
pytestmark = pytest.mark.slow

BASE = ["stage=train", "engine=hf", "logger=none", "trainer.max_steps=8", "train.ttt_steps=2",
        "draft=sglang",
        "vocab.draft_vocab_size=256", "export.format=[vllm,speculators]"]
WARM = ["stage=train", "engine=hf", "logger=csv", "trainer.max_steps=24", "train.ttt_steps=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """A draft trained briefly on the tiny default, exported as vllm and speculators."""
    return TrainedRun(tmp_path_factory.mktemp("base"), cache_dir, *BASE)


def tensors(folder: Path) -> dict:
    from eagle3x import published

    p = published.read(folder)
    return {p.names[k]: v for k, v in load_file(str(folder / "model.safetensors")).items()}


def test_training_writes_every_format_and_they_hold_the_same_tensors(base):
    assert base.result.returncode == 0, base.result.stderr[-3000:]
    vllm, spec = base.run / "draft", base.run / "draft-speculators"
    assert json.loads((spec / "config.json").read_text())["speculators_model_type"] == "eagle3"
    a, b = tensors(vllm), tensors(spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stage_export_converts_a_published_draft_without_training(base, tmp_path):
    """speculators' folder -> vllm and sglang folders; every tensor identical, the aux ids
    the same, no data read (no vocab stage runs)."""
    assert base.result.returncode == 0
    out = tmp_path / "conv"
    r = base.cli("stage=export", f"draft.init={base.run / 'draft-speculators'}",
                 "export.format=[sglang,vllm]", f"train.output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stage vocab" not in r.stdout + r.stderr
    want = tensors(base.run / "draft")
    for folder in (out / "draft", out / "draft-vllm"):
        got = tensors(folder)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((out / "draft" / "config.json").read_text())
    orig = json.loads((base.run / "draft" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == orig["eagle_aux_hidden_state_layer_ids"]


@pytest.mark.parametrize("fmt", ["draft", "draft-speculators"])
def test_draft_init_loads_every_weight_and_keeps_the_drafts_vocabulary(base, fmt, tmp_path):
    """The module training starts from holds the published weights exactly (float32 of
    the bf16 export) and its d2t / t2d; the vocab stage says it kept them."""
    from eagle3x.stages import vocab
    from eagle3x.stages.train import build_module

    assert base.result.returncode == 0
    args = ["stage=train", "engine=hf", f"draft.init={base.run / fmt}",
            "vocab.draft_vocab_size=64", f"train.output_dir={tmp_path / 'w'}"]
    with environment(base.root, base.env):
        settings, plan = plan_for(args)
        vocab.run(plan)
        v = vocab.load(plan.vocab.folder)
        module = build_module(plan, settings.train, settings.trainer.max_steps)
    assert v["manifest"]["stats"]["mapping"] == "kept"
    published = tensors(base.run / fmt)
    state = module.draft.state_dict()
    assert len(v["d2t"]) == 256 and torch.equal(torch.from_numpy(v["d2t"]), published["d2t"])
    for name, t in published.items():
        if name.startswith("embed_tokens"):
            continue
        assert torch.equal(state[name], t.float() if t.is_floating_point() else t), name


def test_vocab_remap_moves_lm_head_rows_with_their_tokens(base, tmp_path):
    """vocab.remap=true: a new map of another size; a token in both keeps its published
    row, a new token starts from the verifier's lm_head row."""
    from eagle3x.stages import vocab
    from eagle3x.stages.train import build_module
    from eagle3x.weights import verifier_head

    assert base.result.returncode == 0
    args = ["stage=train", "engine=hf", f"draft.init={base.run / 'draft'}", "vocab.remap=true",
            "vocab.draft_vocab_size=300", f"train.output_dir={tmp_path / 'w'}"]
    with environment(base.root, base.env):
        settings, plan = plan_for(args)
        vocab.run(plan)
        v = vocab.load(plan.vocab.folder)
        module = build_module(plan, settings.train, settings.trainer.max_steps)
        head = verifier_head(plan.verifier.path, plan.verifier.tied_head).float()
    stats = v["manifest"]["stats"]
    assert stats["mapping"] == "remapped" and len(v["d2t"]) == 300
    pub = tensors(base.run / "draft")
    old_targets = (torch.arange(len(pub["d2t"])) + pub["d2t"]).tolist()
    new_targets = (torch.arange(300) + torch.from_numpy(v["d2t"])).tolist()
    lm = module.draft.lm_head.weight.detach()
    kept = new = 0
    for i, t in enumerate(new_targets):
        if t in old_targets:
            assert torch.equal(lm[i], pub["lm_head.weight"][old_targets.index(t)].float()), t
            kept += 1
        else:
            assert torch.equal(lm[i], head[t]), t
            new += 1
    assert kept == stats["kept_rows"] > 0 and new == stats["new_rows"] > 0


def _start(base: TrainedRun, out: Path, init: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3x", *WARM, f"draft.init={init}",
                             f"train.output_dir={out}"], cwd=base.root,
                            env=dict(os.environ, **base.env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def test_a_killed_warm_start_resumes_from_its_checkpoint_not_the_published_draft(base):
    """A warm start trained without interruption and one killed after a checkpoint then
    started again end with the same weights: the restart continued from the checkpoint
    (reloading the published draft would have thrown away the steps trained)."""
    assert base.result.returncode == 0
    init = base.run / "draft"
    whole = base.root / "warm-whole"
    r = base.cli(*WARM, f"draft.init={init}", f"train.output_dir={whole}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "draft.init: starting from the eagle3x draft" in r.stdout + r.stderr
    killed = base.root / "warm-killed"
    proc = _start(base, killed, init)
    deadline = time.time() + 600
    target = killed / "checkpoints" / "step000010.ckpt"
    while time.time() < deadline and proc.poll() is None and not target.exists():
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be stopped"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    step = torch.load(killed / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["global_step"]
    assert 10 <= step < 24
    r = base.cli(*WARM, f"draft.init={init}", f"train.output_dir={killed}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    assert "draft.init: starting from" not in r.stdout + r.stderr
    _assert_same_training(whole, killed)


@pytest.mark.vllm
def test_vllm_serves_the_speculators_export_as_trained(cli, store, tmp_path):
    """export.format=[speculators] first: <run dir>/draft is speculators' folder, which
    vLLM reads by auto-detection (its config.json's speculators_model_type; the
    --speculative-config points at the folder) beside the verifier in float32; eval.live's
    parity probe: what vLLM's drafter computes equals the trained draft (<= 1e-3)."""
    pytest.importorskip("vllm")
    common = ["engine=hf", "logger=none", "train.ttt_steps=3", "eval.depth=3",
              "trainer.max_steps=20", f"train.output_dir={tmp_path / 'run'}",
              "export.format=[speculators,vllm]"]
    r = cli("stage=train", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and "eagle_config" not in cfg
    r = cli("stage=eval", "eval.live=true", "engine.dtype=float32", "eval.prompts=4", *common)
    assert r.returncode == 0, r.stderr[-4000:]
    live = json.loads((tmp_path / "run" / "eval.json").read_text())["live"]
    assert live["parity_max_rel_error"] <= 1e-3, live["parity"]
    assert live["speculative_paths_consistent"] and live["served"]["drafts"] > 0
