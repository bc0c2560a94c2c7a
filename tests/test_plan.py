"""The resolved plan: fingerprints and folders, train.resume, and each input hashed once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import messages_record, plan_for, settings_for, write_jsonl


@pytest.fixture
def data(tmp_path) -> Path:
    records = [messages_record(("user", f"question {i}"), ("assistant", f"answer {i}"))
               for i in range(40)]
    return write_jsonl(tmp_path / "d.jsonl", records)


def plan(store, *overrides):
    from eagle3x.plan import resolve

    return resolve(settings_for(["stage=train", *overrides]))


def test_store_folders_are_keyed_by_their_fingerprints(store, data):
    p = plan(store, f"data.path={data}")
    for ref in (p.prepared, p.hidden, p.vocab):
        assert not ref.explicit and ref.folder == store.absolute() / ref.kind / ref.fingerprint
    assert len({p.prepared.fingerprint, p.hidden.fingerprint, p.vocab.fingerprint}) == 3


def test_each_setting_changes_exactly_the_artifacts_it_decides(store, data):
    base = plan(store, f"data.path={data}")

    def changed(*overrides):
        other = plan(store, f"data.path={data}", *overrides)
        return {k for k in ("prepared", "hidden", "vocab")
                if getattr(other, k).fingerprint != getattr(base, k).fingerprint}

    everything = {"prepared", "hidden", "vocab"}
    assert changed("data.seed=1") == everything
    assert changed("extract.max_seq_len=300") == everything
    assert changed("extract.aux_layer_ids=[0,2,5]") == {"hidden"}
    assert changed("extract.dtype=float32") == {"hidden"}
    assert changed("data.num_samples=5") == {"vocab"}  # extraction grows one prefix
    assert changed("data.holdout_samples=4") == {"vocab"}
    assert changed("vocab.draft_vocab_size=100") == {"vocab"}
    assert changed("train.lr=0.5", "extract.batch_size=3", "engine=hf") == set()


def test_data_content_is_part_of_the_fingerprint(store, data):
    before = plan(store, f"data.path={data}")
    with open(data, "a", encoding="utf-8") as f:
        f.write(json.dumps(messages_record(("user", "one more"), ("assistant", "ok"))) + "\n")
    after = plan(store, f"data.path={data}")
    assert after.source.fingerprint != before.source.fingerprint
    assert after.prepared.fingerprint != before.prepared.fingerprint


def test_explicit_folders_win_over_the_store(store, data, tmp_path):
    p = plan(store, f"data.path={data}", f"prepare.output_dir={tmp_path}/p",
             f"extract.output_dir={tmp_path}/h", f"vocab.output_dir={tmp_path}/v",
             f"train.output_dir={tmp_path}/run")
    assert (p.prepared.folder, p.hidden.folder, p.vocab.folder, p.run_dir) == (
        tmp_path / "p", tmp_path / "h", tmp_path / "v", tmp_path / "run")
    assert p.prepared.explicit and p.hidden.explicit and p.vocab.explicit
    # extract.prepared_data names the prepared folder even when prepare.output_dir is set.
    p2 = plan(store, f"data.path={data}", f"prepare.output_dir={tmp_path}/p",
              f"extract.prepared_data={tmp_path}/q")
    assert p2.prepared.folder == tmp_path / "q"


def test_describe_is_json_and_names_every_folder(store, data):
    p = plan(store, f"data.path={data}")
    d = json.loads(json.dumps(p.describe()))
    assert d["stage"] == "train" and d["aux_layer_ids"] == list(p.aux_layer_ids)
    assert {d[k]["folder"] for k in ("prepared", "hidden", "vocab")} == {
        str(p.prepared.folder), str(p.hidden.folder), str(p.vocab.folder)}
    assert d["prepared"]["exists"] is False


@pytest.mark.slow
def test_plan_flag_prints_the_plan_and_runs_nothing(cli, store, data):
    r = cli("--plan", "stage=train", f"data.path={data}")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["hidden"]["fingerprint"] == plan(store, f"data.path={data}").hidden.fingerprint
    assert "Hydra job folder" in shown["run_dir"]  # not a folder the run would never use
    assert not store.exists()


@pytest.mark.slow
def test_plan_flag_shows_each_sweep_job_with_the_shared_extraction(cli, store, data):
    r = cli("--plan", "-m", "stage=all", f"data.path={data}", "data.holdout_samples=4",
            "data.num_samples=5,10")
    assert r.returncode == 0, r.stderr
    jobs = json.loads(r.stdout)
    assert [j["split"]["num_samples"] for j in jobs] == [5, 10]
    assert [j["split"]["min_samples"] for j in jobs] == [10, 10]
    assert len({j["hidden"]["folder"] for j in jobs}) == 1 and not store.exists()


def test_a_reusable_vocabulary_needs_no_prepared_data(store, tiny_verifier, cache_dir):
    """stage=vocab (and export, which runs it first) reuse a finished vocabulary even when
    the prepared data it was counted from is gone: nothing is prepared for it. Another
    vocabulary needs the prepared data: it is prepared first."""
    import shutil

    from eagle3x.__main__ import stage_plan, validate
    from eagle3x.stages import vocab
    from tests.helpers import prepared_store

    folder = prepared_store(store.parent, cache_dir)
    _, p = plan_for(["stage=vocab"])
    assert vocab.run(p).status == "built"
    shutil.rmtree(folder)
    for stage in ("vocab", "export"):
        assert validate([f"stage={stage}"]) == []
        settings, p = plan_for([f"stage={stage}"])
        assert [(s["stage"], s["does"]) for s in stage_plan(p, settings)] == (
            [("vocab", "reuses")] + ([("export", "runs")] if stage == "export" else []))
    assert validate(["stage=vocab", "vocab.draft_vocab_size=100"]) == []
    settings, p = plan_for(["stage=vocab", "vocab.draft_vocab_size=100"])
    assert [(s["stage"], s["does"]) for s in stage_plan(p, settings)] == [
        ("prepare", "builds"), ("vocab", "builds")]


def test_resume_is_read_in_one_place(tmp_path):
    from eagle3x.plan import Resume, last_checkpoint

    run = tmp_path / "run"
    auto, none = Resume.parse("auto"), Resume.parse("none")
    assert auto.training_checkpoint(run) is None and none.training_checkpoint(run) is None
    last = last_checkpoint(run)
    last.parent.mkdir(parents=True)
    last.write_bytes(b"x")
    assert auto.training_checkpoint(run) == last and none.training_checkpoint(run) is None
    assert auto.export_checkpoint(run) == last == none.export_checkpoint(run)
    given = Resume.parse(str(tmp_path / "other.ckpt"))
    assert given.problem() and "no checkpoint file" in given.problem()
    (tmp_path / "other.ckpt").write_bytes(b"y")
    assert given.problem() is None
    assert given.training_checkpoint(run) == given.export_checkpoint(run) == tmp_path / "other.ckpt"


def test_file_fingerprint_is_read_once_until_the_file_changes(tmp_path, monkeypatch):
    from eagle3x import artifacts

    reads = []
    real = artifacts._hash_input
    monkeypatch.setattr(artifacts, "_hash_input", lambda p, size: reads.append(p) or real(p, size))
    f = tmp_path / "x.jsonl"
    f.write_text("one\n")
    first = artifacts.file_fingerprint(f)
    assert artifacts.file_fingerprint(f) == first and len(reads) == 1
    f.write_text("two, longer\n")
    assert artifacts.file_fingerprint(f) != first and len(reads) == 2


def test_a_same_size_edit_in_the_middle_is_a_new_fingerprint(tmp_path):
    """The whole file is hashed (not its size and ends), and the memo is keyed by the
    file's inode, size, mtime and ctime, so an edit that keeps the size is seen."""
    from eagle3x import artifacts

    f = tmp_path / "big.jsonl"
    line = b'{"messages": [{"role": "user", "content": "x"}]}\n'
    f.write_bytes(line * 60000)  # ~3 MB: several read blocks
    memo = tmp_path / "memo"
    first = artifacts.file_fingerprint(f, memo)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] = ord("y") if data[len(data) // 2] != ord("y") else ord("z")
    stat = f.stat()
    f.write_bytes(bytes(data))
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    assert f.stat().st_size == stat.st_size
    artifacts._FINGERPRINTS.clear()
    assert artifacts.file_fingerprint(f, memo) != first
    assert artifacts.input_facts(f, memo).records == 60000


def test_input_facts_are_remembered_across_processes(tmp_path, monkeypatch):
    """A second process (here: a cleared in-process memo) reads the facts from the memo
    folder, not the file; a rewrite of the file is read again."""
    from eagle3x import artifacts

    f = tmp_path / "d.jsonl"
    f.write_text('{"a": "xy"}\n\n{"a": "z"}\n')
    memo = tmp_path / "memo"
    reads = []
    real = artifacts._hash_input
    monkeypatch.setattr(artifacts, "_hash_input", lambda p, size: reads.append(p) or real(p, size))
    facts = artifacts.input_facts(f, memo)
    assert (facts.records, facts.first_line, facts.sampled, facts.sample_chars) == (2, 1, 2, 3)
    artifacts._FINGERPRINTS.clear()
    assert artifacts.input_facts(f, memo) == facts and len(reads) == 1
    f.write_text('{"a": "xy"}\n')
    artifacts._FINGERPRINTS.clear()
    assert artifacts.input_facts(f, memo).records == 1 and len(reads) == 2


def _count_opens(monkeypatch, path: Path) -> list:
    """Every open() of `path` from now on (builtins.open and io.open, which pathlib uses)."""
    import builtins
    import io

    opened = []
    target = str(path.resolve())
    real = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == target:
            opened.append(args[0] if args else kwargs.get("mode", "r"))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return opened


@pytest.mark.slow
def test_stage_all_opens_the_data_file_twice_and_a_reusing_run_never(
        store, tiny_verifier, monkeypatch, tmp_path):
    """`stage=all` in-process (validation, then every stage): the data file is opened once
    to hash it (the same read counts its records and checks its first one) and once to
    prepare it; a second run, with nothing in this process remembered, reuses every
    artifact and the remembered facts and opens it not at all. Each input file is hashed
    once."""
    import shutil

    from eagle3x import artifacts
    from eagle3x.__main__ import validate
    from eagle3x.pipeline import run_stages, stages_for
    from eagle3x.resources import resource

    data = tmp_path / "conversations.jsonl"  # a path no earlier run has hashed
    shutil.copyfile(resource("sample_conversations.jsonl"), data)
    artifacts._FINGERPRINTS.clear()
    reads = []
    real = artifacts._hash_input
    monkeypatch.setattr(artifacts, "_hash_input", lambda p, size: reads.append(str(p)) or real(p, size))
    opened = _count_opens(monkeypatch, data)
    argv = ["stage=all", "engine=hf", "logger=none", "data=jsonl", f"data.path={data}",
            "data.num_samples=16", "trainer.max_steps=2", "train.ttt_steps=2",
            f"train.output_dir={tmp_path / 'run'}"]
    assert validate(argv) == []
    settings, p = plan_for(argv)
    outcomes = run_stages(p, settings, stages_for(settings.stage))
    assert [o.kind for o in outcomes] == ["prepared", "hidden", "vocab", "draft", "eval"]
    assert [o.status for o in outcomes[:3]] == ["built"] * 3
    assert len(opened) == 2, opened
    assert str(data) in reads and len(reads) == len(set(reads)), sorted(reads)

    artifacts._FINGERPRINTS.clear()
    opened.clear()
    assert validate(argv) == []
    settings, p = plan_for(argv)
    outcomes = run_stages(p, settings, stages_for(settings.stage))
    assert [o.status for o in outcomes[:3]] == ["reused"] * 3
    assert opened == []
