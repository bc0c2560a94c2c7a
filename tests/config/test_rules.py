"""Rules declared beside their schema fields, applied by eagle3x.config.rules (in-process)."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from eagle3x.config.rules import check_values, declared_rules

RULES = list(declared_rules())


def composed():
    from eagle3x.config.compose import load_config

    return load_config(["stage=train"])


def test_every_rule_guards_a_key_that_exists():
    from eagle3x.config.compose import all_keys

    keys = set(all_keys(composed()))
    assert RULES and {k for k, _ in RULES} <= keys


@pytest.mark.parametrize("key,rule", RULES, ids=[k for k, _ in RULES])
def test_schema_defaults_satisfy_their_rules(key, rule):
    from eagle3x.config.schema import Eagle3xConfig

    section, leaf = key.split(".")
    default = getattr(getattr(Eagle3xConfig(), section), leaf)
    assert rule.ok(default), (key, default)


# A value each rule must refuse, chosen by reading its `why`.
BAD = {"data.holdout_samples": -1, "data.num_samples": 0, "engine.tensor_parallel_size": 0,
       "engine.gpu_memory_utilization": 1.5, "engine.max_num_batched_tokens": 0,
       "extract.aux_layer_ids": [1, 2], "extract.max_seq_len": 1, "extract.batch_size": 0,
       "extract.shard_tokens": 0, "extract.topk": 0, "extract.workers": 0,
       "extract.worker": -1, "vocab.draft_vocab_size": 0, "vocab.coverage": 1.5,
       "vocab.max_draft_vocab_size": 0, "train.ttt_steps": 0,
       "train.step_weight": 0.0, "train.lr": 0.0, "train.warmup_steps": -1,
       "train.batch_size": 0, "train.num_workers": -1, "train.attention_block": 8,
       "train.loss_chunk": 0, "train.max_tokens": 8, "train.checkpoint_mlp_tokens": -1,
       "train.muon_lr": 0.0, "train.min_lr_ratio": 1.5, "train.teacher_topk": 0,
       "train.feature_noise": 1.5,
       "draft.num_layers": 0, "draft.sliding_window": 1,
       "trainer.num_nodes": 0, "trainer.max_steps": 0,
       "trainer.max_epochs": 0, "trainer.max_time": 0.0, "trainer.accumulate_grad_batches": 0,
       "trainer.log_every_n_steps": 0, "eval.depth": 0, "eval.max_samples": 0,
       "eval.prompts": 0, "eval.max_new_tokens": 1, "regenerate.temperature": -1.0,
       "regenerate.top_p": 0.0, "regenerate.max_new_tokens": 0, "regenerate.chunk_size": 0,
       "regenerate.batch_size": 0,
       "logger.mode": "sometimes", "hidden.prefetch": 0, "serve.port": 70000,
       "data.name": "not a hub name", "data.num_proc": 0, "data.chunk_size": 0,
       "engine.rpc_timeout": 0, "train.keep_checkpoints": -1, "train.progress_seconds": 0.0,
       "draft.init": " ", "eval.concurrency": [1, 0], "eval.max_prompts": 0,
       "eval.temperatures": [0.0, 2.5], "export.format": ["vllm", "vllm"]}


def test_every_rule_has_a_refused_example():
    assert set(BAD) == {k for k, _ in RULES}


@pytest.mark.parametrize("key", sorted(BAD))
def test_a_value_breaking_its_rule_is_reported_with_the_key_and_why(key):
    cfg = composed()
    OmegaConf.update(cfg, key, BAD[key], merge=False)
    problems = check_values(cfg)
    why = dict(RULES)[key].why
    assert [(p.key, p.message) for p in problems] == [(key, why + ".")]


def test_checked_fields_keep_their_defaults_and_types():
    from eagle3x.config.schema import ExtractConfig, TrainConfig

    assert ExtractConfig().batch_size == 8 and TrainConfig().lr == 3e-3
    types = {f.name: f.type for f in dataclasses.fields(ExtractConfig)}
    assert types["batch_size"] in (int, "int")
