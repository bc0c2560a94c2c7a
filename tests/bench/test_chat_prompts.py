"""bench/chat_prompts.py: the broad chat set stands for other traffic than the bundled set's,
and is the same text on every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
chat_prompts = pytest.importorskip("chat_prompts")

BUNDLED = REPO / "eagle3x" / "resources" / "sample_conversations.jsonl"


def bundled_prompts():
    rows = [json.loads(line) for line in BUNDLED.read_text(encoding="utf-8").splitlines()]
    return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]


def test_the_bundled_kinds_are_recognised_and_none_is_built():
    """Every bundled request is of one of BUNDLED_KINDS (so the rule covers the whole target
    set, and a new bundled kind would fail here), and no prompt of the chat set is."""
    bundled = bundled_prompts()
    assert len(bundled) == 320 and chat_prompts.bundled_overlap(bundled) == bundled
    built = [r["messages"][0]["content"] for r in chat_prompts.build(None, 0)]
    assert len(built) > 1000
    assert chat_prompts.bundled_overlap(built) == []
    assert not set(built) & set(bundled)


def test_deterministic_distinct_and_seeded():
    a, b = chat_prompts.build(None, 0), chat_prompts.build(None, 0)
    assert a == b
    prompts = [r["messages"][0]["content"] for r in a]
    assert len(set(prompts)) == len(prompts)
    assert [r["id"] for r in chat_prompts.build(50, 0)] == [r["id"] for r in a[:50]]
    other = chat_prompts.build(None, 1)
    assert {r["messages"][0]["content"] for r in other} == set(prompts)
    assert [r["messages"][0]["content"] for r in other] != prompts
    # no single kind dominates: the largest is under a quarter of the set
    kinds = {}
    for r in a:
        kinds[r["source"].split(":")[0]] = kinds.get(r["source"].split(":")[0], 0) + 1
    assert max(kinds.values()) < len(a) / 4, kinds
