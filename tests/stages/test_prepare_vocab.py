"""Stage prepare (chat template, loss mask, order) and stage vocab (d2t / t2d semantics)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3x.data.conversations import DataError, iter_conversations
from eagle3x.stages.vocab import build_mapping
from tests.helpers import messages_record, sharegpt_record, stage_output, write_jsonl

CONVS = [
    (("user", "hi"), ("assistant", "Hello there")),
    (("system", "Be brief."), ("user", "What is 2 plus 2?"), ("assistant", "4."),
     ("user", "And 3 plus 3?"), ("assistant", "6.")),
    (("user", "Spell cat backwards."), ("assistant", "tac")),
]


@pytest.fixture
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_verifier))


def test_loss_mask_is_exactly_the_assistant_reply_hand_checked(tok):
    """Tokenize the pieces by hand: prompt part must be 0, reply + end-of-turn must be 1."""
    from eagle3x.data.chat import encode

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask, cut = encode(tok, messages, 512, "x")
    prompt = "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    reply = "Hello there<|im_end|>\n"
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    r_ids = tok(reply, add_special_tokens=False).input_ids
    assert ids == p_ids + r_ids
    assert mask == [0] * len(p_ids) + [1] * len(r_ids)
    assert not cut
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == reply


def test_multi_turn_masks_only_assistant_turns(tok):
    from eagle3x.data.chat import encode

    messages = [{"role": r, "content": c} for r, c in CONVS[1]]
    ids, mask, _ = encode(tok, messages, 512, "x")
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "4.<|im_end|>\n6.<|im_end|>\n"


def test_truncation_counts_and_cuts(tok):
    from eagle3x.data.chat import encode

    messages = [{"role": r, "content": c} for r, c in CONVS[1]]
    ids, mask, cut = encode(tok, messages, 10, "x")
    assert cut and len(ids) == 10 and len(mask) == 10


def _prepare(cli, path, *extra):
    r = cli("stage=prepare", f"data.path={path}", *extra)
    assert r.returncode == 0, r.stderr
    from eagle3x.data.prepared import load

    return load(stage_output(r, "prepare"))


@pytest.mark.slow
def test_both_jsonl_shapes_give_identical_prepared_data(cli, tmp_path, tiny_verifier):
    a = _prepare(cli, write_jsonl(tmp_path / "m.jsonl", [messages_record(*c) for c in CONVS]))
    b = _prepare(cli, write_jsonl(tmp_path / "s.jsonl", [sharegpt_record(*c) for c in CONVS]))
    for key in ("input_ids", "loss_mask", "offsets", "source_line"):
        np.testing.assert_array_equal(a[key], b[key])
    assert a["n"] == 3 and a["manifest"]["stats"]["loss_tokens"] == int(a["loss_mask"].sum())


@pytest.mark.slow
def test_seeded_order_is_stable_and_changes_with_seed(cli, tmp_path, tiny_verifier):
    recs = [messages_record(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    first = _prepare(cli, path)["source_line"]
    again = _prepare(cli, path, "prepare.output_dir=" + str(tmp_path / "again"))["source_line"]
    other = _prepare(cli, path, "data.seed=1")["source_line"]
    np.testing.assert_array_equal(first, again)
    assert sorted(first.tolist()) == list(range(1, 21))
    assert first.tolist() != other.tolist()


@pytest.mark.slow
def test_long_sample_is_truncated_and_counted_not_an_error(cli, tmp_path, tiny_verifier):
    long = messages_record(("user", "hello"), ("assistant", "word " * 400))
    data = _prepare(cli, write_jsonl(tmp_path / "d.jsonl", [long]), "extract.max_seq_len=64")
    assert data["manifest"]["stats"]["truncated"] == 1
    assert int(data["offsets"][-1]) == 64


@pytest.mark.parametrize("line,needle", [
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}', "empty assistant turn"),
    ('{"text": "hello"}', 'no "messages" or "conversations"'),
    ('[1, 2]', "expected a json object"),
    ('{"messages": []}', "empty"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
])
def test_bad_record_named_by_file_and_line(tmp_path, line, needle):
    good = json.dumps(messages_record(("user", "a"), ("assistant", "b")))
    path = write_jsonl(tmp_path / "d.jsonl", [good, line])
    with pytest.raises(DataError) as e:
        list(iter_conversations(path))
    assert f"{path}:2" in str(e.value) and needle in str(e.value)


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(messages_record(("user", "a"), ("assistant", "b"))).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8"):
        list(iter_conversations(path))


@pytest.mark.slow
def test_malformed_later_line_fails_the_stage_and_writes_nothing(cli, store, tmp_path, tiny_verifier):
    good = messages_record(("user", "a"), ("assistant", "b"))
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, "{oops"])
    r = cli("stage=prepare", f"data.path={path}")
    assert r.returncode == 1 and f"{path}:3" in r.stderr
    prepared = store / "prepared"
    assert not prepared.exists() or not any(p.name[0] != "." for p in prepared.iterdir())


def test_datasets_folder_is_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = [messages_record(*c) for c in CONVS]
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "ds"))
    got = [c.messages for c in iter_conversations(tmp_path / "ds")]
    assert got == [[{"role": r, "content": c} for r, c in conv] for conv in CONVS]


# ---- vocab ---------------------------------------------------------------------------

def test_mapping_keeps_most_frequent_ties_to_lower_id():
    counts = np.array([0, 5, 3, 5, 0, 3, 1])
    d2t, t2d, filled = build_mapping(counts, 3)
    chosen = np.arange(3) + d2t
    assert chosen.tolist() == [1, 2, 3]  # 1 and 3 (5 each), then 2 beats 5 on the tie
    assert t2d.tolist() == [False, True, True, True, False, False, False] and filled == 0


def test_mapping_fills_with_lowest_unused_ids():
    d2t, t2d, filled = build_mapping(np.array([0, 0, 7, 0, 2]), 4)
    assert (np.arange(4) + d2t).tolist() == [0, 1, 2, 4] and filled == 2


def test_mapping_is_consistent_for_random_counts():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=300) * (rng.random(300) < 0.5)
    d2t, t2d, _ = build_mapping(counts, 64)
    target = np.arange(64) + d2t
    assert np.all(np.diff(target) > 0) and t2d.sum() == 64 and t2d[target].all()
    assert counts[target].min() >= np.sort(counts)[::-1][63]


@pytest.mark.slow
def test_vocab_stage_counts_trained_tokens_of_the_sample_prefix(cli, tmp_path, tiny_verifier):
    from eagle3x.data import prepared
    from eagle3x.stages import vocab

    assert cli("stage=prepare").returncode == 0
    r = cli("stage=vocab", "data.num_samples=50", "vocab.draft_vocab_size=100")
    assert r.returncode == 0, r.stderr
    v = vocab.load(stage_output(r, "vocab"))
    data = prepared.load(stage_output(cli("stage=prepare"), "prepare"))
    hold = 32  # data=sample holds out the first 32 samples; training counts the next 50
    expected = {}
    for k in range(hold, hold + 50):
        a, b = int(data["offsets"][k]), int(data["offsets"][k + 1])
        for t, m in zip(data["input_ids"][a:b], data["loss_mask"][a:b]):
            if m:
                expected[int(t)] = expected.get(int(t), 0) + 1
    assert {i: int(c) for i, c in enumerate(v["counts"]) if c} == expected
    top = sorted(expected, key=lambda t: (-expected[t], t))[:100]
    assert sorted(top) == (np.arange(100) + v["d2t"]).tolist()
    assert v["t2d"].dtype == np.bool_ and v["d2t"].dtype == np.int64
