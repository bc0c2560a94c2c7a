"""Conversations as users have them, read into the one shape the chat template receives;
bad ones refused naming file:line and the turn, at startup or in prepare, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3x.data.conversations import DataError, Fields, iter_conversations, normalize
from eagle3x.testing import chat_zoo
from tests.helpers import write_jsonl


def one(record, **kw):
    return normalize(record, "d.jsonl:1", **kw)


def test_openai_tool_calls_reasoning_and_parts_normalised_as_vllm_does():
    conv = one({"tools": json.dumps(chat_zoo.WEATHER), "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be"},
                                          {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning": "Tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "-3"}]},
        {"role": "assistant", "content": "Cold.", "reasoning_content": "Below zero."}]})
    assert conv.tools == chat_zoo.WEATHER
    assert conv.messages == [
        {"role": "developer", "content": "Be\nbrief."},  # text parts joined as vLLM joins them
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": "", "reasoning_content": "Tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Cold.", "reasoning_content": "Below zero."}]
    again = one(conv.record())  # the normal form reads back as itself
    assert again.messages == conv.messages and again.tools == conv.tools


def test_sharegpt_function_call_and_observation_are_a_tool_call_and_its_result():
    share = one({"tools": json.dumps([chat_zoo.WEATHER[0]["function"]]), "conversations": [
        {"from": "system", "value": "S"},
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                       "arguments": {"city": "Rome"}})},
        {"from": "observation", "value": '{"temp": 30}'},
        {"from": "gpt", "value": "Hot."}]})
    openai = one({"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": '{"temp": 30}'}, {"role": "assistant", "content": "Hot."}]})
    assert share.messages == openai.messages
    assert share.tools == [chat_zoo.WEATHER[0]["function"]]  # bare function schemas kept


def test_field_mapping_reads_other_columns():
    rec = {"dialog": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
           "functions": chat_zoo.WEATHER, "sys": "Be kind."}
    conv = one(rec, fields=Fields(messages="dialog", tools="functions", system="sys"))
    assert conv.messages[0] == {"role": "system", "content": "Be kind."}
    assert conv.tools == chat_zoo.WEATHER
    with pytest.raises(DataError, match="no 'turns' column"):
        one(rec, fields=Fields(messages="turns"))


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD = [
    ("arguments not json", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     r"turn 1 \(assistant\): malformed tool call 0 \(f\): arguments are not valid json"),
    ("arguments a list", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     r"turn 1 \(assistant\): malformed tool call 0 \(f\): arguments must be a json object"),
    ("no name", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
     r"turn 1 \(assistant\): malformed tool call 0: no function name"),
    ("result without call", [{"role": "user", "content": "q"},
                             {"role": "tool", "content": "42"},
                             {"role": "assistant", "content": "a"}],
     r"turn 1 \(tool\): a tool result with no tool call before it"),
    ("result after a text reply", [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "1"},
                                   {"role": "assistant", "content": "a"},
                                   {"role": "tool", "content": "2"}],
     r"turn 4 \(tool\): a tool result with no tool call before it"),
    ("unknown call id", [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "", "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "c9", "content": "1"},
                         {"role": "assistant", "content": "a"}],
     r"turn 2 \(tool\): a tool result for tool_call_id 'c9', which no tool call before it has"),
    ("reasoning on a user turn", [{"role": "user", "content": "q", "reasoning_content": "hm"},
                                  {"role": "assistant", "content": "a"}],
     r"turn 0 \(user\): reasoning on a user turn"),
    ("image part", [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]},
                    {"role": "assistant", "content": "A cat."}],
     r"turn 0 \(user\): an image content part \(image_url\)"),
    ("tool calls on a user turn", [{"role": "user", "content": "q", "tool_calls": [CALL]},
                                   {"role": "assistant", "content": "a"}],
     r"turn 0 \(user\): tool_calls on a user turn"),
    ("empty reply", [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
     r"turn 1 is an empty assistant turn"),
]


@pytest.mark.parametrize("name,turns,message", BAD, ids=[b[0] for b in BAD])
def test_bad_conversation_named_by_file_line_and_turn(tmp_path, name, turns, message):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, {"messages": turns}])
    with pytest.raises(DataError, match=rf"{path}:3: {message}"):
        list(iter_conversations(path))


def snapshot(root: Path) -> dict:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.slow
@pytest.mark.parametrize("first", [True, False], ids=["first-line-at-startup", "later-line-in-prepare"])
def test_a_malformed_tool_call_is_refused_and_nothing_is_written(cli, store, tmp_path,
                                                                 tiny_verifier, first):
    bad = {"messages": BAD[0][1]}
    good = chat_zoo.agentic()
    path = write_jsonl(tmp_path / "d.jsonl", [bad, good] if first else [good] * 5 + [bad])
    r = cli("stage=prepare", "data=jsonl", f"data.path={path}", "data.chunk_size=2")
    where = f"{path}:1" if first else f"{path}:6"
    assert r.returncode == (2 if first else 1), r.stderr[-2000:]
    assert f"{where}: turn 1 (assistant): malformed tool call 0 (f)" in r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(store) == {}  # no artifact, no scratch chunks left


@pytest.mark.slow
def test_tool_and_reasoning_conversations_prepare_on_the_tiny_default(cli, store, tmp_path,
                                                                      tiny_verifier):
    """The embedded tiny template renders neither reasoning nor tool calls: prepare says so
    and trains what it renders."""
    path = write_jsonl(tmp_path / "d.jsonl", chat_zoo.dataset(12))
    r = cli("stage=prepare", "data=jsonl", f"data.path={path}")
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert "does not render the reasoning of 20 assistant turns" in log
    assert "does not render the tool calls of 4 assistant turns" in log
    m = json.loads(next((store / "prepared").glob("*/manifest.json")).read_text())
    assert m["stats"]["turns"]["tool_results"] == 4 and m["stats"]["samples"] == 12
