"""Datasets by name (data=hf): read from the local `datasets` cache when the hub cannot be
reached, refused at startup naming the dataset when neither is possible. The dataset is
written into a cache folder of the test, as `datasets` lays out a hub dataset it has
downloaded; nothing touches the network."""

from __future__ import annotations

import json
import shutil

import pytest

from eagle3x.data import prepared
from eagle3x.testing import chat_zoo
from tests.helpers import plan_for, write_jsonl

NAME = "acme/ToolChats"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_dataset(cache, tmp_path, records, name=NAME, commit=COMMIT):
    """`records` as the train split of hub dataset `name` at `commit` in datasets cache
    `cache`: <org>___<name>/default/0.0.0/<commit>/ (dataset_info.json, arrow file)."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    src = write_jsonl(tmp_path / "rows.jsonl", records)
    short = camelcase_to_snakecase(name.split("/")[1])
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name=short, hash=commit,
                   data_files={"train": str(src)})
    builder.download_and_prepare()
    dest = cache / f"{name.split('/')[0]}___{short}" / "default" / "0.0.0" / commit
    dest.parent.mkdir(parents=True)
    shutil.copytree(builder.cache_dir, dest)
    return dest


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty datasets cache, and no way to the hub."""
    cache = tmp_path / "hf-datasets"
    cache.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from eagle3x import hub as client

    client._HUB.clear()
    return cache


def test_the_cache_path_is_spelled_as_datasets_spells_it():
    from datasets.naming import camelcase_to_snakecase

    from eagle3x.hub import snake_name

    for name in ("ToolChats", "glaive-function-calling-v2", "OpenHermes2.5", "XLAM_60k", "ABCdef",
                 "sharegpt_90k", "a1B"):
        assert snake_name(name) == camelcase_to_snakecase(name), name


@pytest.mark.parametrize("streaming", [False, True])
def test_a_cached_dataset_prepares_offline_by_name(store, tmp_path, hub, tiny_verifier, streaming):
    records = [{"conv": r["messages"], "tools": r.get("tools")} for r in chat_zoo.dataset(9)]
    cached_dataset(hub, tmp_path, records)
    _, plan = plan_for(["stage=prepare", "data=hf", f"data.name={NAME}", "data.split=train",
                        "data.fields.messages=conv", f"data.streaming={str(streaming).lower()}"])
    assert plan.source.revision == COMMIT and plan.source.cached and plan.source.records == 9
    d = prepared.load(prepared.build(plan).path)
    assert d["n"] == 9 and sorted(d["source_line"].tolist()) == list(range(1, 10))
    assert d["manifest"]["settings"]["data"] == NAME
    assert d["manifest"]["settings"]["revision"] == COMMIT
    assert d["manifest"]["stats"]["turns"]["tool_results"] == 3


def test_the_same_rows_by_name_and_from_a_file_prepare_alike(store, tmp_path, hub, tiny_verifier):
    records = chat_zoo.dataset(6)
    cached_dataset(hub, tmp_path, [{"messages": r["messages"], "tools": r.get("tools")}
                                   for r in records])
    _, by_name = plan_for(["stage=prepare", "data=hf", f"data.name={NAME}"])
    _, by_file = plan_for(["stage=prepare", "data=jsonl",
                           f"data.path={write_jsonl(tmp_path / 'same.jsonl', records)}"])
    a = prepared.load(prepared.build(by_name).path)
    b = prepared.load(prepared.build(by_file).path)
    assert (a["input_ids"] == b["input_ids"]).all() and (a["loss_mask"] == b["loss_mask"]).all()


def test_a_dataset_neither_cached_nor_reachable_is_refused_at_startup(cli, hub, tiny_verifier):
    r = cli("stage=prepare", "data=hf", "data.name=acme/Missing")
    assert r.returncode == 2
    assert "x data.name=acme/Missing" in r.stderr
    assert "the dataset acme/Missing, split train cannot be read: not in the local datasets " \
           f"cache ({hub})" in r.stderr and "offline (HF_HUB_OFFLINE" in r.stderr


def test_an_unreachable_hub_is_named(cli, hub, monkeypatch, tiny_verifier):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    r = cli("stage=prepare", "data=hf", "data.name=acme/Missing",
            env={"HF_ENDPOINT": "http://127.0.0.1:9"})  # nothing listens on the discard port
    assert r.returncode == 2 and "the hub cannot be reached" in r.stderr


def test_the_split_is_checked_against_the_cached_examples(cli, tmp_path, hub, tiny_verifier):
    cached_dataset(hub, tmp_path, chat_zoo.dataset(5))
    r = cli("stage=train", "data=hf", f"data.name={NAME}", "data.holdout_samples=2",
            "data.num_samples=10")
    assert r.returncode == 2 and f"but {NAME} holds 5" in r.stderr
    r = cli("stage=prepare", "data=hf", f"data.name={NAME}", "data.path=/x.jsonl")
    assert r.returncode == 2 and "which one?" in r.stderr
