"""Bad inputs: each is a clear error naming the file, line or key, a non-zero exit, and
no artifact created or overwritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import messages_record, write_jsonl

GOOD = json.dumps(messages_record(("user", "hi"), ("assistant", "hello")))


def snapshot(root: Path) -> dict:
    """Every file under the artifact store with its size and mtime (for 'nothing changed')."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


def data_file(tmp: Path, lines) -> str:
    return f"data.path={write_jsonl(tmp / 'd.jsonl', lines)}"


def raw_file(tmp: Path, content: bytes) -> str:
    (tmp / "d.jsonl").write_bytes(content)
    return f"data.path={tmp / 'd.jsonl'}"


def verifier_copy(tmp: Path, src: Path, drop=(), edit=None) -> str:
    dst = tmp / "verifier"
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if edit:
        edit(dst)
    return f"verifier.path={dst}"


def no_template(d: Path) -> None:
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


# (id, argument builder, expected exit code, text that must be in the error)
CASES = [
    ("empty-file", lambda t, v: ["stage=prepare", raw_file(t, b"")], 2, "empty file"),
    ("not-json", lambda t, v: ["stage=prepare", data_file(t, ["{nope"])], 2, "d.jsonl:1: not json"),
    ("wrong-shape", lambda t, v: ["stage=prepare", data_file(t, ['{"text": "x"}'])], 2, 'no "messages"'),
    ("unknown-role", lambda t, v: ["stage=prepare", data_file(t, [json.dumps(
        {"messages": [{"role": "wizard", "content": "x"}]})])], 2, "unknown role 'wizard'"),
    ("empty-assistant", lambda t, v: ["stage=prepare", data_file(t, [json.dumps(messages_record(
        ("user", "x"), ("assistant", "")))])], 2, "empty assistant turn"),
    ("non-utf8", lambda t, v: ["stage=prepare", raw_file(t, b"\xff\xfe{}\n")], 2, "not UTF-8"),
    ("bad-later-line", lambda t, v: ["stage=prepare", data_file(t, [GOOD, GOOD, "[1,"])], 1, "d.jsonl:3"),
    ("unknown-role-later", lambda t, v: ["stage=prepare", data_file(t, [GOOD, json.dumps(
        {"conversations": [{"from": "alien", "value": "x"}]})])], 1, "d.jsonl:2"),
    ("sharegpt-missing-value", lambda t, v: ["stage=prepare", data_file(t, [json.dumps(
        {"conversations": [{"from": "human"}]})])], 2, "needs 'from' and 'value'"),
    ("no-assistant-turn", lambda t, v: ["stage=prepare", data_file(t, [json.dumps(messages_record(
        ("user", "x")))])], 2, "no assistant turn"),
    ("data-folder-not-dataset", lambda t, v: ["stage=prepare", f"data.path={t}"], 2,
     "not a datasets save_to_disk folder"),
    ("num-samples-beyond-data", lambda t, v: ["stage=prepare", data_file(t, [GOOD] * 3),
                                              "data.num_samples=5"], 2, "holds 3"),
    ("num-samples-zero", lambda t, v: ["stage=prepare", "data.num_samples=0"], 2, "at least 1"),
    ("no-config-json", lambda t, v: ["stage=prepare", "verifier=local",
                                     verifier_copy(t, v, drop=["config.json"])], 2, "no config.json"),
    ("no-weights", lambda t, v: ["stage=prepare", "verifier=local",
                                 verifier_copy(t, v, drop=["model.safetensors"])], 2, "no *.safetensors"),
    ("bad-config-json", lambda t, v: ["stage=prepare", "verifier=local", verifier_copy(
        t, v, edit=lambda d: (d / "config.json").write_text("{"))], 2, "not a usable model config"),
    ("no-chat-template", lambda t, v: ["stage=prepare", "verifier=local",
                                       verifier_copy(t, v, edit=no_template)], 2, "no chat template"),
    ("aux-id-too-high", lambda t, v: ["stage=extract", "extract.aux_layer_ids=[1,2,8]"], 2, "out of range"),
    ("aux-id-negative", lambda t, v: ["stage=extract", "extract.aux_layer_ids=[-1,2,3]"], 2, "three layer ids"),
    ("draft-vocab-too-big", lambda t, v: ["stage=vocab", "vocab.draft_vocab_size=2048"], 2,
     "larger than the verifier's vocabulary"),
    ("draft-vocab-zero", lambda t, v: ["stage=vocab", "vocab.draft_vocab_size=0"], 2, "at least 1"),
    ("batch-negative", lambda t, v: ["stage=extract", "extract.batch_size=-3"], 2, "at least 1"),
    ("seq-len-zero", lambda t, v: ["stage=prepare", "extract.max_seq_len=0"], 2, "at least 2"),
    ("lr-zero", lambda t, v: ["stage=train", "train.lr=0"], 2, "must be positive"),
    ("step-weight-high", lambda t, v: ["stage=train", "train.step_weight=1.5"], 2, "(0, 1]"),
    ("gpu-util-high", lambda t, v: ["stage=extract", "engine.gpu_memory_utilization=2"], 2, "(0, 1]"),
    ("output-not-writable", lambda t, v: ["stage=all", "extract.output_dir=/proc/1/eagle3x"], 2,
     "is not writable"),
    ("output-under-a-file", lambda t, v: ["stage=prepare", f"prepare.output_dir={t}/f/x"], 2,
     "is not a folder"),
    ("disk-too-small", lambda t, v: ["stage=all"], 2, "not enough disk"),
    ("override-twice", lambda t, v: ["stage=prepare", "data.seed=1", "data.seed=2"], 2, "given twice"),
    ("unknown-key", lambda t, v: ["stage=prepare", "prepare.ouput_dir=/x"], 2, "prepare.output_dir"),
    ("wrong-type", lambda t, v: ["stage=prepare", "data.seed=one"], 2, "wrong type"),
    ("bad-group-option", lambda t, v: ["stage=prepare", "logger=wandbb"], 2, "did you mean `wandb`"),
    ("resume-missing", lambda t, v: ["stage=train", f"train.resume={t}/no.ckpt"], 2, "no checkpoint file"),
    ("tp-beyond-gpus", lambda t, v: ["stage=extract", "engine.tensor_parallel_size=4"], 2, "GPU(s)"),
    ("hf-with-tp", lambda t, v: ["stage=extract", "engine=hf", "engine.tensor_parallel_size=2"], 2,
     "one device"),
]


@pytest.fixture(scope="module")
def prepared_store(tmp_path_factory, tiny_verifier, cache_dir):
    """A store holding real prepared data, made once (in-process); each case gets a copy."""
    root = tmp_path_factory.mktemp("prepared-store")
    helpers.prepared_store(root, cache_dir)
    return root / "artifacts"


@pytest.mark.slow
@pytest.mark.parametrize("name,build,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_nothing_is_written(name, build, code, needle, cli, store, tmp_path,
                                                     tiny_verifier, prepared_store):
    if name == "output-under-a-file":
        (tmp_path / "f").write_text("a file")
    shutil.copytree(prepared_store, store)
    before = snapshot(store)
    assert before
    env = {"EAGLE3X_FREE_BYTES": "1000"} if name == "disk-too-small" else None
    if name == "tp-beyond-gpus":
        env = {"EAGLE3X_GPU_COUNT": "2"}
    r = cli(*build(tmp_path, tiny_verifier), env=env)
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert needle in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert snapshot(store) == before


@pytest.mark.slow
def test_long_sample_is_truncated_and_counted_not_refused(cli, store, tmp_path, tiny_verifier):
    long = json.dumps(messages_record(("user", "x"), ("assistant", "word " * 500)))
    r = cli("stage=prepare", data_file(tmp_path, [long, GOOD]), "extract.max_seq_len=32")
    assert r.returncode == 0
    m = json.loads(next((store / "prepared").glob("*/manifest.json")).read_text())
    assert m["stats"]["truncated"] == 1
