"""The loss mask under the real families' chat templates, token by token.

Each family's published template (eagle3x/testing/chat_templates) with a tokenizer built
locally whose special tokens are the family's. For an agentic conversation (system prompt,
tools, reasoning on both replies, a tool call with empty content, its result) and a
two-question conversation with reasoning, the runs of trained tokens, decoded, must be
exactly the replies as the model generates them after the template's generation prompt:
reasoning, tool-call arguments and end-of-turn token, nothing of the system, user or tool
turns. The expected strings are written here from each template's published format, not
taken from eagle3x's output.
"""

from __future__ import annotations

import pytest

from eagle3x.data.chat import ChatSettings, layout, tokenize
from eagle3x.data.conversations import DataError, normalize
from eagle3x.testing import chat_zoo

CALL = '{"city": "Paris"}'

#: template -> trained runs of chat_zoo.agentic() (one sample)
AGENTIC = {
    "qwen3": ['<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              f'"arguments": {CALL}}}\n</tool_call><|im_end|>\n',
              "<think>\nIt is warm.\n</think>\n\n21 degrees in Paris.<|im_end|>\n"],
    "llama3_1": [f'{{"name": "get_weather", "parameters": {CALL}}}<|eot_id|>',
                 "21 degrees in Paris.<|eot_id|>"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    f"```json\n{CALL}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                    "21 degrees in Paris.<｜end▁of▁sentence｜>"],
    "deepseek_v3_1": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                      f"{CALL}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                      "21 degrees in Paris.<｜end▁of▁sentence｜>"],
    # the tool call's analysis stays in the prompt until a final reply: both in one sample
    "gpt_oss": ["<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant "
                "to=functions.get_weather<|channel|>commentary json<|message|>"
                f"{CALL}<|call|>",
                "<|channel|>analysis<|message|>It is warm.<|end|><|start|>assistant<|channel|>"
                "final<|message|>21 degrees in Paris.<|return|>"],
    # Kimi keeps reasoning after the last plain reply only: the answer's is never rendered
    "kimi_k2": ["<think>Need the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>"
                f"call_0<|tool_call_argument_begin|>{CALL}<|tool_call_end|>"
                "<|tool_calls_section_end|><|im_end|>",
                "<think></think>21 degrees in Paris.<|im_end|>"],
    # plain ChatML renders content only: the tool call turn is just its end
    "chatml": ["<|im_end|>\n", "21 degrees in Paris.<|im_end|>\n"],
}

#: template -> (reasoning turns not rendered, tool-call turns not rendered) in agentic()
NOT_RENDERED = {"qwen3": (0, 0), "llama3_1": (2, 0), "deepseek_v3": (2, 0),
                "deepseek_v3_1": (2, 0), "gpt_oss": (0, 0), "kimi_k2": (1, 0), "chatml": (2, 1)}

#: template -> trained runs of multi_turn(1), one list per sample (split_turns where needed)
MULTI = {
    "qwen3": [["<think>\nR1\n</think>\n\nA1<|im_end|>\n"],
              ["<think>\nR2\n</think>\n\nA2<|im_end|>\n"]],
    "gpt_oss": [["<|channel|>analysis<|message|>R1<|end|><|start|>assistant<|channel|>final"
                 "<|message|>A1<|return|>"],
                ["<|channel|>analysis<|message|>R2<|end|><|start|>assistant<|channel|>final"
                 "<|message|>A2<|return|>"]],
    "llama3_1": [["A1<|eot_id|>", "A2<|eot_id|>"]],
    "deepseek_v3": [["A1<｜end▁of▁sentence｜>", "A2<｜end▁of▁sentence｜>"]],
    "deepseek_v3_1": [["A1<｜end▁of▁sentence｜>", "A2<｜end▁of▁sentence｜>"]],
    "kimi_k2": [["<think></think>A1<|im_end|>", "<think></think>A2<|im_end|>"]],
    "chatml": [["A1<|im_end|>\n", "A2<|im_end|>\n"]],
}


@pytest.fixture(scope="module")
def tokenizers(cache_dir):
    from transformers import AutoTokenizer

    made = {}

    def get(name):
        if name not in made:
            folder = chat_zoo.build_tokenizer(
                name, cache_dir / chat_zoo.CHAT_ZOO_ID / f"tokenizer-{name}")
            made[name] = AutoTokenizer.from_pretrained(str(folder))
        return made[name]
    return get


def samples(tok, record, **settings):
    """[(text, trained runs decoded)] for each sample of one conversation, and the stats."""
    conv = normalize(record, "d.jsonl:7")
    stats = {}
    out = []
    for piece in layout(tok, conv.messages, conv.tools, "d.jsonl:7",
                        ChatSettings(4096, **settings), stats):
        ids, mask, _ = tokenize(tok, piece, 4096)
        assert tok.decode(ids, skip_special_tokens=False) == piece.text  # every char, once
        runs, cur = [], []
        for i, m in zip(ids + [None], mask + [0]):
            if m:
                cur.append(i)
            elif cur:
                runs.append(tok.decode(cur, skip_special_tokens=False))
                cur = []
        out.append((piece.text, runs))
    return out, stats


@pytest.mark.parametrize("name", sorted(AGENTIC))
def test_agentic_conversation_trains_exactly_the_replies(name, tokenizers):
    out, stats = samples(tokenizers(name), chat_zoo.agentic())
    assert [runs for _, runs in out] == [AGENTIC[name]]
    text = out[0][0]
    for untrained in ("You are a weather bot.", "Weather in Paris?", "temp"):
        assert untrained in text  # rendered ...
    trained = "".join(AGENTIC[name])
    for never in ("You are a weather bot.", "Weather in Paris?", "temp"):
        assert never not in trained  # ... but never trained
    assert (stats["assistant_turns"], stats["tool_results"], stats["tool_call_turns"],
            stats["reasoning_turns"]) == (2, 1, 1, 2)
    assert (stats.get("reasoning_not_rendered", 0),
            stats.get("tool_calls_not_rendered", 0)) == NOT_RENDERED[name]


@pytest.mark.parametrize("name", sorted(MULTI))
def test_two_questions_with_reasoning(name, tokenizers):
    tok = tokenizers(name)
    split = len(MULTI[name]) > 1
    if split:  # the template drops turn 1's reasoning once turn 3 follows: refused ...
        with pytest.raises(DataError, match=r"d\.jsonl:7: turn 1 \(assistant\): the chat "
                                            r"template renders this turn differently"):
            samples(tok, chat_zoo.multi_turn())
    out, stats = samples(tok, chat_zoo.multi_turn(), split_turns=True)  # ... or cut
    assert [runs for _, runs in out] == MULTI[name]
    assert stats.get("split_conversations", 0) == int(split)
    if split:  # each sample ends with the turn it trains, rendered as serving renders it
        assert out[0][0].endswith(MULTI[name][0][0]) and "Q2" not in out[0][0]
        assert "R1" not in out[1][0]  # the later prompt, as served, without turn 1's reasoning


def test_split_keeps_turns_together_where_the_template_allows(tokenizers):
    """A conversation whose first answer loses its reasoning later, but whose agentic tail
    renders as a prefix: two samples, the tool call and the answer after it in one."""
    tok = tokenizers("qwen3")
    rec = chat_zoo.agentic()
    first = {"role": "assistant", "reasoning_content": "Greet.", "content": "Hi."}
    rec["messages"][1:1] = [{"role": "user", "content": "Hello"}, first]
    out, _ = samples(tok, rec, split_turns=True)
    assert [runs for _, runs in out] == [["<think>\nGreet.\n</think>\n\nHi.<|im_end|>\n"],
                                         AGENTIC["qwen3"]]


def test_reasoning_and_tool_calls_can_be_left_untrained(tokenizers):
    tok = tokenizers("qwen3")
    out, _ = samples(tok, chat_zoo.agentic(), train_reasoning=False)
    assert out[0][1] == ["<think>\n", "\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                         f"\"arguments\": {CALL}}}\n</tool_call><|im_end|>\n",
                         "<think>\n", "\n</think>\n\n21 degrees in Paris.<|im_end|>\n"]
    out, _ = samples(tok, chat_zoo.agentic(), train_tool_calls=False)
    assert out[0][1] == ["<think>\nNeed the tool.\n</think>\n\n", "<|im_end|>\n",
                         "<think>\nIt is warm.\n</think>\n\n21 degrees in Paris.<|im_end|>\n"]
    out, _ = samples(tokenizers("gpt_oss"), chat_zoo.agentic(), train_reasoning=False)
    assert out[0][1] == ["<|end|><|start|>assistant to=functions.get_weather<|channel|>"
                         f"commentary json<|message|>{CALL}<|call|>",
                         "<|end|><|start|>assistant<|channel|>final<|message|>21 degrees in "
                         "Paris.<|return|>"]
    assert "Need the tool." not in "".join(out[0][1]) and "It is warm." not in "".join(out[0][1])


def test_a_template_whose_prompt_opens_a_block_its_replies_lack_is_refused(tokenizers):
    """DeepSeek-R1's generation prompt ends with <think>\\n, its rendered replies have none:
    the reply the model generates cannot be located. DeepSeek-V3.1 in thinking mode alike;
    with thinking off it trains."""
    with pytest.raises(DataError, match=r"d\.jsonl:7: turn 2 \(assistant\): the chat template's "
                                        r"generation prompt ends with .*<think>"):
        samples(tokenizers("deepseek_r1"), chat_zoo.agentic())
    tok = tokenizers("deepseek_v3_1")
    with pytest.raises(DataError, match=r"turn 1 \(assistant\).*generation prompt"):
        samples(tok, chat_zoo.multi_turn(), template_kwargs={"thinking": True})
    out, _ = samples(tok, chat_zoo.multi_turn(), template_kwargs={"thinking": False})
    assert [runs for _, runs in out] == MULTI["deepseek_v3_1"]


def test_a_template_error_names_the_turn(tokenizers):
    """GPT-OSS refuses content and thinking together on a tool-call turn."""
    rec = chat_zoo.agentic()
    rec["messages"][2]["content"] = "Let me look."
    with pytest.raises(DataError, match=r"d\.jsonl:7: turn 2 \(assistant\): the chat template "
                                        r"fails on it: .*both content and thinking"):
        samples(tokenizers("gpt_oss"), rec)
