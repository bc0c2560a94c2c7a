"""The transformers generator's batched loop (eagle3x.engines.generate.decode): left-padded
batches give the replies one-at-a-time decoding gives, each row ending at its own stop
token or limit, and a step stopped early hands back the finished replies and the rest."""

from __future__ import annotations

import pytest
import torch

#: Every test here starts an engine or a process (tests/conftest.py's quick-loop guard).
pytestmark = pytest.mark.slow

PROMPTS = ["What is 12 plus 30?", "Hi", "Spell garden backwards, then tell me why gardens grow.",
           "Is 7 prime?", "Name a colour.", "How many metres are in 3 km? Think it through."]
LIMITS = [40, 5, 40, 6, 40, 12]


@pytest.fixture(scope="module")
def setup(tiny_verifier):
    from eagle3x.data.chat import render
    from eagle3x.engines.generate import stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    prompts = [tok(render(tok, [{"role": "user", "content": p}], True),
                   add_special_tokens=False).input_ids for p in PROMPTS]
    return tok, prompts, stop_ids(tiny_verifier, tok)


def one_at_a_time(model, prompt, limit, stops):
    """transformers' own generate(), one prompt, no padding: the reference."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit,
                         do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(new) if t in stops), None)
    return (new, True) if cut is None else (new[:cut], False)


@pytest.mark.parametrize("batch_size,prefill", [(1, 4096), (4, 4096), (16, 4096), (4, 24)])
def test_batched_greedy_is_one_at_a_time_greedy(tiny_verifier, setup, batch_size, prefill):
    """(prefill 24 over 4 rows: the prompts prefilled 6 columns at a time)"""
    from eagle3x.engines.generate import HFGenerator, Sampling

    tok, prompts, stops = setup
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stops, batch_size=batch_size)
    gen.prefill_tokens = prefill
    got = gen.generate(prompts, Sampling(0.0, 1.0, 40, 0), LIMITS, [0] * len(prompts))
    want = [one_at_a_time(gen.model, p, lim, stops) for p, lim in zip(prompts, LIMITS)]
    assert [(r.token_ids, r.hit_length) for r in got] == want
    # the cases that matter were there: a row stopped early, a row at its limit, lengths differ
    assert any(not h for _, h in want) and any(h for _, h in want)
    assert len({len(p) for p in prompts}) > 1


def test_a_stopped_step_keeps_what_finished_and_requeues_the_rest(tiny_verifier, setup):
    from eagle3x.engines.generate import HFGenerator, Request, Sampling

    tok, prompts, stops = setup
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stops, batch_size=len(prompts))
    gen.prefill_tokens = 10 ** 6  # one prefill: the steps counted are decode steps
    sampling = Sampling(0.0, 1.0, 40, 0)
    whole = gen.generate(prompts, sampling, LIMITS, [0] * len(prompts))
    steps = []

    def on_step(tokens):
        steps.append(tokens)
        return len(steps) < 6  # stop after the sixth decode step

    gen.submit([Request(k, p, lim, 0) for k, (p, lim) in enumerate(zip(prompts, LIMITS))],
               sampling)
    first = dict(gen.step(on_step))
    assert len(steps) == 6 and 0 < gen.pending() < len(prompts)
    # a row ends at the step that makes its stop token (one past its reply) or its last token
    ends = [len(r.token_ids) + (not r.hit_length) for r in whole]
    assert set(first) == {k for k, e in enumerate(ends) if e <= 6} and min(ends) < 6 < max(ends)
    assert all(first[k] == whole[k] for k in first)
    rest = {}
    while gen.pending():
        rest.update(gen.step())
    assert set(rest) | set(first) == set(range(len(prompts))) and not set(rest) & set(first)
    assert [({**first, **rest})[k] for k in range(len(prompts))] == whole


def test_sampled_replies_follow_their_seed_not_their_batch(tiny_verifier, setup):
    from eagle3x.engines.generate import HFGenerator, Sampling

    tok, prompts, stops = setup
    sampling = Sampling(1.0, 0.9, 20, 0)
    seeds = list(range(len(prompts)))
    alone = HFGenerator(tiny_verifier, "float32", "cpu", False, stops, batch_size=1)
    together = HFGenerator(tiny_verifier, "float32", "cpu", False, stops, batch_size=8)
    a = alone.generate(prompts, sampling, [20] * len(prompts), seeds)
    b = together.generate(prompts, sampling, [20] * len(prompts), seeds)
    assert a == b
    other = together.generate(prompts, sampling, [20] * len(prompts), [s + 100 for s in seeds])
    assert other != b  # the seed is what decides


def test_the_greedy_estimates_continuations_are_one_at_a_time_greedy(tiny_verifier, setup):
    """eval.offline=greedy with engine=hf decodes through the same batched loop: past the
    stop token, `length` tokens each, the argmax of a full forward pass at every step."""
    from transformers import AutoModelForCausalLM

    from eagle3x.engines.hf import HFEngine
    from eagle3x.evaluation.offline import _hf_greedy

    tok, prompts, stops = setup
    model = AutoModelForCausalLM.from_pretrained(str(tiny_verifier), dtype=torch.float32).eval()
    head = model.get_output_embeddings().weight.detach().float()
    eng = HFEngine(tiny_verifier, [0, 1, 2], "float32", "cpu")
    got = _hf_greedy(eng, head, prompts, 14, batch=4)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(14):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p):])
    assert got == want
    assert any(t in stops for path in want for t in path)  # it went on past a stop token


def test_a_stop_during_a_long_prefill_comes_between_its_slices(tiny_verifier, setup):
    from eagle3x.engines.generate import HFGenerator, Request, Sampling

    tok, prompts, stops = setup
    gen = HFGenerator(tiny_verifier, "float32", "cpu", False, stops, batch_size=len(prompts))
    gen.prefill_tokens = 2 * len(prompts)  # two columns a slice: many slices
    calls = []
    gen.submit([Request(k, p, 8, 0) for k, p in enumerate(prompts)], Sampling(0.0, 1.0, 8, 0))
    assert gen.step(lambda tokens: calls.append(tokens) or len(calls) < 3) == []
    assert calls == [0, 0, 0] and gen.pending() == len(prompts)  # no token made; all queued
