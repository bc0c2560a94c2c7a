"""Regeneration with the new message shapes (transformers, in-process): turns that call
tools are kept as written, text replies are regenerated from the render with the
conversation's tools, and the original author's reasoning goes with the replaced text."""

from __future__ import annotations

import pytest
import torch

from eagle3x.config.schema import RegenerateConfig
from eagle3x.data.conversations import normalize
from eagle3x.data.regenerate import split_reasoning
from tests.data.test_regenerate import greedy
from eagle3x.testing import chat_zoo


@pytest.mark.slow
def test_tool_calls_are_kept_and_replies_regenerated(tiny_verifier):
    from transformers import AutoModelForCausalLM

    from eagle3x.data.chat import render
    from eagle3x.data.regenerate import regenerate_chunk
    from eagle3x.engines.generate import HFGenerator, stop_ids
    from eagle3x.verifier import load_tokenizer

    conv = normalize(chat_zoo.agentic(), "d.jsonl:1")
    conv.line = 1
    tok = load_tokenizer(tiny_verifier)
    stops = stop_ids(tiny_verifier, tok)
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stops)
    records, counts = regenerate_chunk(gen, tok, [conv], 0, RegenerateConfig(max_new_tokens=10),
                                       {}, 2048)
    assert counts["replies"] == 1 and records[0]["tools"] == conv.tools
    got = records[0]["messages"]
    assert got[:4] == conv.messages[:4]  # system, user, the tool call (with its reasoning), result
    model = AutoModelForCausalLM.from_pretrained(str(tiny_verifier), dtype=torch.float32).eval()
    prompt = tok(render(tok, got[:4], True, {}, conv.tools), add_special_tokens=False).input_ids
    want = tok.decode(greedy(model, prompt, 10, stops), skip_special_tokens=True).strip()
    assert got[4] == {"role": "assistant", "content": want}  # the author's reasoning is gone
    assert normalize(records[0], "regenerated.jsonl:1").messages == got  # reads back as itself


def test_reasoning_the_verifier_writes_in_think_tags_becomes_the_turns_reasoning():
    assert split_reasoning("<think>\nLet me see.\n</think>\n\nIt is 4.") == {
        "role": "assistant", "content": "It is 4.", "reasoning_content": "Let me see."}
    assert split_reasoning("Plain.") == {"role": "assistant", "content": "Plain."}
