"""Regeneration in-process (transformers): each reply is the verifier's own greedy
continuation of the conversation so far, earlier turns already regenerated."""

from __future__ import annotations

import pytest
import torch

from eagle3x.config.schema import RegenerateConfig, Turns
from eagle3x.data.conversations import Conversation

CONVS = [Conversation(1, [{"role": "user", "content": "What is 12 plus 30?"},
                       {"role": "assistant", "content": "It is forty-two, I think."},
                       {"role": "user", "content": "And times 2?"},
                       {"role": "assistant", "content": "Eighty-four."}]),
         Conversation(2, [{"role": "system", "content": "You are a helpful assistant."},
                       {"role": "user", "content": "Spell garden backwards."},
                       {"role": "assistant", "content": "nedrag"}])]


def greedy(model, ids, limit, stops):
    """Argmax decoding written out, independent of transformers' generate()."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(limit):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if t in stops:
                break
            ids.append(t)
            out.append(t)
    return out


@pytest.mark.slow
def test_every_turn_is_the_verifiers_greedy_reply_to_the_regenerated_past(tiny_verifier):
    from transformers import AutoModelForCausalLM

    from eagle3x.data.chat import render
    from eagle3x.data.regenerate import regenerate_chunk
    from eagle3x.engines.generate import HFGenerator, stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    stops = stop_ids(tiny_verifier, tok)
    assert stops == {tok.eos_token_id}
    settings = RegenerateConfig(max_new_tokens=12)
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stops)
    records, counts = regenerate_chunk(gen, tok, CONVS, 0, settings, {}, 2048)
    assert counts["replies"] == 3 and len(records) == 2

    model = AutoModelForCausalLM.from_pretrained(str(tiny_verifier), dtype=torch.float32).eval()
    for conv, rec in zip(CONVS, records):
        got = rec["messages"]
        assert [m["role"] for m in got] == [m["role"] for m in conv.messages]
        for i, m in enumerate(got):
            if m["role"] != "assistant":
                assert m == conv.messages[i]  # other turns kept
                continue
            prompt = tok(render(tok, got[:i], True), add_special_tokens=False).input_ids
            want = tok.decode(greedy(model, prompt, 12, stops), skip_special_tokens=True).strip()
            assert m["content"] == want and m["content"] != conv.messages[i]["content"]


@pytest.mark.slow
def test_last_turn_only_keeps_the_earlier_replies(tiny_verifier):
    from eagle3x.data.regenerate import regenerate_chunk
    from eagle3x.engines.generate import HFGenerator, stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stop_ids(tiny_verifier, tok))
    records, counts = regenerate_chunk(gen, tok, CONVS[:1], 0,
                                       RegenerateConfig(max_new_tokens=6, turns=Turns.last), {}, 2048)
    got = records[0]["messages"]
    assert counts["replies"] == 1 and got[1] == CONVS[0].messages[1]
    assert got[3]["content"] != CONVS[0].messages[3]["content"]


@pytest.mark.slow
def test_a_reply_at_the_token_limit_is_marked_and_can_be_dropped(tiny_verifier):
    from eagle3x.config.schema import OnLength
    from eagle3x.data.regenerate import regenerate_chunk
    from eagle3x.engines.generate import HFGenerator, stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stop_ids(tiny_verifier, tok))
    kept, counts = regenerate_chunk(gen, tok, CONVS, 0, RegenerateConfig(max_new_tokens=2), {}, 2048)
    assert counts["hit_length"] == 3 and all(r["hit_length"] for r in kept) and len(kept) == 2
    dropped, counts = regenerate_chunk(gen, tok, CONVS, 0,
                                       RegenerateConfig(max_new_tokens=2, on_length=OnLength.drop),
                                       {}, 2048)
    assert dropped == [] and counts["dropped"]["hit_length"] == 2


@pytest.mark.slow
def test_progress_counts_replies_up_to_the_total_even_for_dropped_conversations(tiny_verifier):
    """The progress display counts replies (a multi-turn conversation finishes only after
    its last one): one per reply made, and a conversation dropped early its turns left,
    so a finished run ends on `reply_count`'s total."""
    from eagle3x.data.regenerate import regenerate_conversations, reply_count
    from eagle3x.engines.generate import HFGenerator, stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stop_ids(tiny_verifier, tok))
    total = sum(reply_count(c, Turns.all) for c in CONVS)
    assert total == 3 and reply_count(CONVS[0], Turns.last) == 1
    todo = list(enumerate(CONVS))
    for context, made in ((2048, 3), (8, 0)):  # 8 tokens: every prompt is too long
        calls, entries = [], []
        assert regenerate_conversations(gen, tok, todo, RegenerateConfig(max_new_tokens=4), {},
                                        context, entries.append, replied=calls.append)
        assert sum(calls) == total and sum(e["replies"] for e in entries) == made
        assert calls.count(1) >= made  # one call per reply made


def test_a_part_file_keeps_whole_lines_only(tmp_path):
    """A kill while a line is written leaves it cut short: it is ignored when read, and cut
    off before the next run appends, so the file stays one whole entry a line."""
    import json

    from eagle3x.data.regenerate import _Part, part_name, read_part

    entries = [{"index": i, "record": None, "dropped": "empty_reply", "replies": 1,
                "new_tokens": 0, "hit_length": 0, "empty": 1} for i in (3, 4, 5)]
    text = "".join(json.dumps(e) + "\n" for e in entries[:2]) + json.dumps(entries[2])[:17]
    (tmp_path / part_name(1)).write_text(text)
    assert sorted(read_part(tmp_path, 1)) == [3, 4]
    part = _Part(tmp_path, 1, 2)
    part.add(entries[2])
    part.close()
    assert read_part(tmp_path, 1) == {e["index"]: e for e in entries}
    assert all(json.loads(x) for x in (tmp_path / part_name(1)).read_text().splitlines())
    assert read_part(tmp_path, 2) == {}
