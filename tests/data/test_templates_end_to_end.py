"""Tool-call and reasoning conversations through the whole pipeline on zoo verifiers that
carry the real families' chat templates: prepare (split_turns where the template needs
it), extract with transformers, vocab, a few training steps, offline eval. In-process
(one Python, libraries imported once) and small, to stay fast."""

from __future__ import annotations

import json

import pytest

from eagle3x.testing import chat_zoo
from tests.helpers import plan_for, write_jsonl

#: template -> whether its conversations need data.split_turns (Qwen3 and GPT-OSS drop an
#: earlier reply's reasoning once another question follows; Kimi drops it always)
FAMILIES = {"tiny-default": False, "qwen3": True, "llama3_1": False, "deepseek_v3": False, "deepseek_v3_1": False,
            "gpt_oss": True, "kimi_k2": False, "chatml": False}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("conv") / "agentic.jsonl", chat_zoo.dataset(12))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prepare_extract_train_eval(name, store, tmp_path, cache_dir, tiny_verifier,
                                    conversations):
    from eagle3x.data.prepared import load
    from eagle3x.pipeline import run_stages, stages_for

    if name == "tiny-default":  # the embedded verifier (its template renders content only)
        pick = []
    else:
        pick = ["verifier=local", f"verifier.path={chat_zoo.build_verifier(name, cache_dir)}",
                "experiment=tiny"]
    argv = ["stage=all", *pick, "engine=hf", "engine.dtype=float32", "logger=none", "data=jsonl",
            f"data.path={conversations}", "data.holdout_samples=3",
            f"data.split_turns={str(FAMILIES[name]).lower()}", "vocab.draft_vocab_size=128",
            "trainer.max_steps=2", "train.ttt_steps=2", "eval.depth=2",
            f"train.output_dir={tmp_path / 'run'}"]
    settings, plan = plan_for(argv)
    outcomes = run_stages(plan, settings, stages_for(settings.stage))
    assert [o.kind for o in outcomes] == ["prepared", "hidden", "vocab", "draft", "eval"]
    data = load(plan.prepared.folder)
    turns = data["manifest"]["stats"]["turns"]
    assert (turns["tool_call_turns"], turns["tool_results"]) == (4, 4)
    assert data["n"] == 12 + (4 if FAMILIES[name] else 0)  # a split conversation: 2 samples
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["positions"] > 0 and 1.0 <= report["mean_accepted_length"] <= 3.0
