"""Prepare in bounded memory: chunks over tokenizer processes give the bytes one process
gives, a killed prepare resumes after its last whole chunk, the streamed file is plain
safetensors, and prepared data opens memory-mapped."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from eagle3x.data import prepared
from eagle3x.testing import chat_zoo
from tests.helpers import plan_for, write_jsonl


def sha(folder) -> str:
    return hashlib.sha256((folder / prepared.FILE).read_bytes()).hexdigest()


@pytest.fixture
def data(tmp_path):
    """The bundled conversations with tool-call and reasoning ones mixed in (350)."""
    from eagle3x.resources import resource

    path = tmp_path / "mixed.jsonl"
    shutil.copyfile(resource("sample_conversations.jsonl"), path)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n")  # a blank line: skipped, line numbers still count it
        for record in chat_zoo.dataset(30):
            f.write(json.dumps(record) + "\n")
    return path


def build(store, tmp_path, data, name, *extra):
    """Prepare `data` into tmp_path/name in this process (one tokenizer process unless
    `extra` says otherwise)."""
    _, plan = plan_for(["stage=prepare", "data=jsonl", f"data.path={data}", "data.num_proc=1",
                        f"prepare.output_dir={tmp_path / name}", *extra])
    out = prepared.build(plan)
    assert out.status == "built"
    return out.path


def test_chunks_over_processes_give_the_bytes_of_one_process(store, tmp_path, data, tiny_verifier):
    one = build(store, tmp_path, data, "one", "data.num_proc=1")
    many = build(store, tmp_path, data, "many", "data.num_proc=2", "data.chunk_size=37")
    assert sha(one) == sha(many)
    m = json.loads((one / "manifest.json").read_text())
    assert m["stats"]["input_conversations"] == 350 and m["stats"]["samples"] == 350
    d = prepared.load(one)
    assert sorted(d["source_line"].tolist()) == list(range(1, 321)) + list(range(322, 352))
    assert not list(tmp_path.glob(".*.chunks"))  # the scratch folder goes with success


def test_a_killed_prepare_resumes_after_its_last_whole_chunk(store, tmp_path, data,
                                                            tiny_verifier, monkeypatch):
    clean = build(store, tmp_path, data, "clean", "data.chunk_size=50")
    real = prepared.encode_chunk
    calls = []

    def dies_on_the_fourth(items, *args):
        calls.append(items[0][0])
        if len(calls) == 4:
            raise KeyboardInterrupt  # a kill between chunks 2 and 3 (0-based) are written
        return real(items, *args)

    monkeypatch.setattr(prepared, "encode_chunk", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        build(store, tmp_path, data, "resumed", "data.chunk_size=50")
    scratch = tmp_path / ".resumed.chunks"
    assert sorted(p.name for p in scratch.glob("chunk-*.json")) == [
        f"chunk-{k:06d}.json" for k in range(3)]
    assert not (tmp_path / "resumed").exists()  # nothing half-written where readers look
    calls.clear()
    monkeypatch.setattr(prepared, "encode_chunk", lambda items, *a: calls.append(items[0][0])
                        or real(items, *a))
    resumed = build(store, tmp_path, data, "resumed", "data.chunk_size=50")
    assert calls == [151, 201, 251, 301]  # the first line of chunks 3..6 only
    assert sha(resumed) == sha(clean)


def test_another_chunk_size_starts_over(store, tmp_path, data, tiny_verifier, monkeypatch):
    real = prepared.encode_chunk
    calls = []

    def dies(items, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(items, *args)

    monkeypatch.setattr(prepared, "encode_chunk", dies)
    with pytest.raises(KeyboardInterrupt):
        build(store, tmp_path, data, "x", "data.chunk_size=100")
    monkeypatch.setattr(prepared, "encode_chunk", real)
    other = build(store, tmp_path, data, "x", "data.chunk_size=60")
    assert sha(other) == sha(build(store, tmp_path, data, "ref", "data.chunk_size=350"))


def test_the_streamed_file_is_plain_safetensors_and_opens_memory_mapped(store, tmp_path, data,
                                                                        tiny_verifier):
    from safetensors.numpy import load_file

    out = build(store, tmp_path, data, "p")
    whole = load_file(str(out / prepared.FILE))
    mapped = prepared.load(out, verify=True)  # sha256 of the file as the manifest records it
    for key in ("input_ids", "loss_mask", "offsets", "source_line"):
        assert isinstance(mapped[key], np.memmap)
        np.testing.assert_array_equal(whole[key], mapped[key])
    assert int(mapped["offsets"][-1]) == len(mapped["input_ids"]) == mapped["manifest"]["stats"]["tokens"]
    mapped["input_ids"][0] = 0  # copy-on-write: writable, the file stays as it was
    assert prepared.load(out, verify=True)["input_ids"][0] == whole["input_ids"][0]


def test_split_conversations_keep_their_samples_together(store, tmp_path, cache_dir):
    """Under Qwen3's template a two-question conversation is two samples, adjacent in the
    seeded order and in turn order."""
    verifier = chat_zoo.build_verifier("qwen3", cache_dir)
    path = write_jsonl(tmp_path / "d.jsonl", chat_zoo.dataset(30))
    _, plan = plan_for(["stage=prepare", "verifier=local", f"verifier.path={verifier}",
                        "experiment=tiny", "data=jsonl", f"data.path={path}",
                        "data.split_turns=true"])
    d = prepared.load(prepared.build(plan).path)
    lines = d["source_line"].tolist()
    m = d["manifest"]["stats"]
    assert m["turns"]["split_conversations"] == 10 and m["samples"] == 40
    for line in set(lines):
        at = [i for i, x in enumerate(lines) if x == line]
        assert at == list(range(at[0], at[0] + len(at)))
        assert len(at) == (2 if (line - 1) % 3 == 1 else 1)
    first = lines.index(2)  # multi_turn(1): "R1" trained in the first sample, "R2" in the second
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(verifier))
    off, ids, mask = d["offsets"], d["input_ids"], d["loss_mask"]
    trained = [tok.decode([t for t, k in zip(ids[off[i]:off[i + 1]], mask[off[i]:off[i + 1]]) if k])
               for i in (first, first + 1)]
    assert trained == ["<think>\nR1\n</think>\n\nA1<|im_end|>\n",
                       "<think>\nR2\n</think>\n\nA2<|im_end|>\n"]
