"""Unit tests for the EAGLE-3 draft (model.py) and its training-time-test objective (ttt.py).

Everything runs on CPU in float32 with a tiny draft. Expectations come from hand-computed
values or from a plain reference written here from the docstrings (a float64, loop-based
re-implementation of one draft step that shares only the weights with the module).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from eagle3x.draft.model import DraftShape, Eagle3Draft, RMSNorm, rope
from eagle3x.draft.ttt import (chain_acceptance, expected_accept_length, shift, ttt_step_metrics,
                               valid_mask, verifier_targets)

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
DRAFT_V, TARGET_V = 16, 40
# target_hidden == target vocab so an identity verifier head lets a test choose the greedy
# token at every position (last_hidden = one-hot of the wanted token).
TARGET_H = TARGET_V


def tiny_shape(num_kv_heads: int = 1, num_heads: int = HEADS,
               head_dim: int = HEAD_DIM) -> DraftShape:
    return DraftShape(hidden_size=HIDDEN, target_hidden_size=TARGET_H, intermediate_size=48,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      draft_vocab_size=DRAFT_V, target_vocab_size=TARGET_V, rope_theta=10000.0)


def vocab_maps(seed: int):
    """(chosen, d2t, t2d) honouring the contract: chosen sorted target ids,
    target_id = draft_id + d2t[draft_id], t2d the bool mask of the chosen ids."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(TARGET_V, generator=g)[:DRAFT_V].sort().values
    d2t = chosen - torch.arange(DRAFT_V)
    t2d = torch.zeros(TARGET_V, dtype=torch.bool)
    t2d[chosen] = True
    return chosen, d2t, t2d


def make_draft(seed: int = 0, num_kv_heads: int = 1, num_heads: int = HEADS,
               head_dim: int = HEAD_DIM) -> Eagle3Draft:
    torch.manual_seed(seed)
    _, d2t, t2d = vocab_maps(seed)
    draft = Eagle3Draft(tiny_shape(num_kv_heads, num_heads, head_dim), d2t, t2d)
    with torch.no_grad():  # norms start at ones; make them distinguishable
        for m in draft.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return draft.eval()


# --------------------------------------------------------------------------------------
# Reference draft step (float64, loops), written from the model docstrings
# --------------------------------------------------------------------------------------

def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., D] (float64), pos broadcastable to x[..., 0]: dimension i pairs with i + D/2
    and turns by pos * theta^(-2i/D)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        a = pos.double() * theta ** (-2.0 * i / d)
        x1, x2 = x[..., i], x[..., i + d // 2]
        out[..., i] = x1 * torch.cos(a) - x2 * torch.sin(a)
        out[..., i + d // 2] = x2 * torch.cos(a) + x1 * torch.sin(a)
    return out


class RefDraft:
    """One sequence of draft steps over all positions at once.

    Step k at position t attends to the step-0 keys of positions 0..t and to the keys of
    steps 1..k at position t only; its hidden input is fc(aux) for k = 0, else the previous
    step's pre-norm output at t.
    """

    def __init__(self, draft: Eagle3Draft, aux: torch.Tensor,
                 positions: Optional[torch.Tensor] = None):
        self.m, self.s = draft, draft.shape
        b, t, _ = aux.shape
        self.positions = positions if positions is not None else torch.arange(t).expand(b, t)
        self.hidden = aux.double() @ self.w(draft.fc).T
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []

    @staticmethod
    def w(lin) -> torch.Tensor:
        return lin.weight.detach().double()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        m, s = self.m, self.s
        layer, attn = m.midlayer, m.midlayer.self_attn
        b, t = tokens.shape
        k = len(self.keys)
        eps = s.rms_norm_eps
        emb = m.embed_tokens.weight.detach().double()[tokens]
        x = torch.cat([ref_rms(emb, layer.input_layernorm.weight.detach(), eps),
                       ref_rms(self.hidden, layer.hidden_norm.weight.detach(), eps)], -1)
        pos = (self.positions + k)[..., None]  # [B, T, 1]
        q = ref_rope((x @ self.w(attn.q_proj).T).view(b, t, s.num_heads, s.head_dim), pos,
                     s.rope_theta)
        kk = ref_rope((x @ self.w(attn.k_proj).T).view(b, t, s.num_kv_heads, s.head_dim), pos,
                      s.rope_theta)
        vv = (x @ self.w(attn.v_proj).T).view(b, t, s.num_kv_heads, s.head_dim)
        self.keys.append(kk)
        self.values.append(vv)
        group = s.num_heads // s.num_kv_heads
        out = torch.zeros(b, t, s.num_heads, s.head_dim, dtype=torch.float64)
        for bi in range(b):
            for ti in range(t):
                for h in range(s.num_heads):
                    g = h // group
                    ks = [self.keys[0][bi, j, g] for j in range(ti + 1)]
                    vs = [self.values[0][bi, j, g] for j in range(ti + 1)]
                    ks += [self.keys[j][bi, ti, g] for j in range(1, k + 1)]
                    vs += [self.values[j][bi, ti, g] for j in range(1, k + 1)]
                    scores = torch.stack(ks) @ q[bi, ti, h] / math.sqrt(s.head_dim)
                    out[bi, ti, h] = torch.softmax(scores, 0) @ torch.stack(vs)
        h1 = out.reshape(b, t, -1) @ self.w(attn.o_proj).T + self.hidden
        post = ref_rms(h1, layer.post_attention_layernorm.weight.detach(), eps)
        mlp = layer.mlp
        h2 = (F.silu(post @ self.w(mlp.gate_proj).T) * (post @ self.w(mlp.up_proj).T)) \
            @ self.w(mlp.down_proj).T + h1
        self.hidden = h2
        return ref_rms(h2, m.norm.weight.detach(), eps) @ self.w(m.lm_head).T


def ref_unroll(draft, aux, token_ids, steps, positions=None) -> List[torch.Tensor]:
    ref = RefDraft(draft, aux, positions)
    t = aux.shape[1]
    return [ref.step(token_ids[:, k:k + t]) for k in range(steps)]


def random_inputs(seed: int, b: int = 2, t: int = 6, extra: int = 3):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, t, 3 * TARGET_H, generator=g)
    tokens = torch.randint(0, TARGET_V, (b, t + extra), generator=g)
    return aux, tokens


# --------------------------------------------------------------------------------------
# RMSNorm, rope, vocabulary maps
# --------------------------------------------------------------------------------------

def test_rmsnorm_divides_by_root_mean_square_then_scales_by_weight():
    norm = RMSNorm(2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, 0.5]))
    out = norm(torch.tensor([[3.0, 4.0]]))
    r = math.sqrt((9 + 16) / 2)
    assert torch.allclose(out, torch.tensor([[2 * 3 / r, 0.5 * 4 / r]]))


def test_rmsnorm_eps_keeps_zero_input_finite():
    out = RMSNorm(4, eps=1e-6)(torch.zeros(1, 4))
    assert torch.equal(out, torch.zeros(1, 4))


def test_rope_at_position_zero_is_identity():
    x = torch.randn(2, 3, 4, 8)
    assert torch.allclose(rope(x, torch.zeros(2, 4, dtype=torch.long), 10000.0), x)


def test_rope_turns_a_two_dim_vector_by_its_position_in_radians():
    x = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    y = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)
    p = torch.tensor([[2]])
    assert torch.allclose(rope(x, p, 10000.0).flatten(), torch.tensor([math.cos(2), math.sin(2)]))
    assert torch.allclose(rope(y, p, 10000.0).flatten(), torch.tensor([-math.sin(2), math.cos(2)]))


def test_rope_pairs_dim_i_with_i_plus_half_at_frequency_theta_pow_minus_2i_over_d():
    # d = 4, theta = 100: pair (0, 2) turns at 1 rad/position, pair (1, 3) at 100^-0.5 = 0.1
    x = torch.tensor([1.0, 1.0, 0.0, 0.0]).view(1, 1, 1, 4)
    out = rope(x, torch.tensor([[3]]), 100.0).flatten()
    want = torch.tensor([math.cos(3.0), math.cos(0.3), math.sin(3.0), math.sin(0.3)])
    assert torch.allclose(out, want, atol=1e-6)


def test_rope_matches_loop_reference_and_preserves_norm():
    x = torch.randn(2, 2, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 9, 11, 50, 100]])
    out = rope(x, pos, 10000.0)
    want = ref_rope(x.double().transpose(1, 2), pos[..., None], 10000.0).transpose(1, 2)
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rope_dot_products_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> float:
        return float((rope(q, torch.tensor([[m]]), 10000.0)
                      * rope(k, torch.tensor([[n]]), 10000.0)).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)


def test_draft_to_target_maps_each_draft_id_to_its_chosen_target_id():
    chosen, d2t, t2d = vocab_maps(3)
    draft = Eagle3Draft(tiny_shape(), d2t, t2d)
    assert torch.equal(draft.draft_to_target(torch.arange(DRAFT_V)), chosen)
    assert bool(draft.t2d[draft.draft_to_target(torch.arange(DRAFT_V))].all())
    assert int(draft.t2d.sum()) == DRAFT_V
    ids = torch.tensor([[0, 15], [7, 7]])
    want = torch.tensor([[int(chosen[0]), int(chosen[15])], [int(chosen[7])] * 2])
    assert torch.equal(draft.draft_to_target(ids), want)


def test_vocab_buffers_are_copies_with_contract_dtypes():
    _, d2t, t2d = vocab_maps(4)
    draft = Eagle3Draft(tiny_shape(), d2t.int(), t2d.to(torch.uint8))
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    before = draft.d2t.clone()
    d2t.add_(1)
    assert torch.equal(draft.d2t, before)
    assert set(dict(draft.named_buffers())) == {"d2t", "t2d"}


# --------------------------------------------------------------------------------------
# Eagle3Draft.unroll / step
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 16), (2, 2, 16), (4, 2, 8)])
def test_unroll_matches_loop_reference_of_training_time_test_attention(heads, kv_heads, head_dim):
    # (4, 2): query heads 0, 1 share kv head 0 and heads 2, 3 share kv head 1
    draft = make_draft(1, kv_heads, heads, head_dim)
    aux, tokens = random_inputs(1)
    with torch.no_grad():
        got = draft.unroll(aux, tokens, 3)
    want = ref_unroll(draft, aux, tokens, 3)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.shape == (2, 6, DRAFT_V)
        assert torch.allclose(g.double(), w, atol=1e-4), (g.double() - w).abs().max()


def test_unroll_with_explicit_positions_matches_reference():
    draft = make_draft(2)
    aux, tokens = random_inputs(2)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
    with torch.no_grad():
        got = draft.unroll(aux, tokens, 2, positions)
    want = ref_unroll(draft, aux, tokens, 2, positions)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=1e-4)


def test_step_returns_draft_logits_and_pre_norm_hidden_that_feeds_the_next_step():
    draft = make_draft(3)
    aux, tokens = random_inputs(3)
    t = aux.shape[1]
    pos = torch.arange(t).expand(2, t)
    ref = RefDraft(draft, aux)
    cache: list = []
    hidden = draft.fc(aux)
    with torch.no_grad():
        for k in range(2):
            logits, hidden = draft.step(tokens[:, k:k + t], hidden, pos + k, cache)
            want = ref.step(tokens[:, k:k + t])
            assert torch.allclose(logits.double(), want, atol=1e-4)
            assert torch.allclose(hidden.double(), ref.hidden, atol=1e-4)
    assert len(cache) == 1 and len(cache[0]) == 2  # one layer, two steps of keys/values


def test_unroll_first_steps_do_not_depend_on_how_many_steps_follow():
    draft = make_draft(4)
    aux, tokens = random_inputs(4)
    with torch.no_grad():
        short, long = draft.unroll(aux, tokens, 2), draft.unroll(aux, tokens, 3)
    for a, b in zip(short, long[:2]):
        assert torch.equal(a, b)


def test_unroll_is_causal_in_the_verifier_features():
    draft = make_draft(5)
    aux, tokens = random_inputs(5)
    p = 3
    aux2 = aux.clone()
    aux2[:, p] += 1.0
    with torch.no_grad():
        a, b = draft.unroll(aux, tokens, 3), draft.unroll(aux2, tokens, 3)
    for la, lb in zip(a, b):
        assert torch.allclose(la[:, :p], lb[:, :p], atol=1e-6)
        assert not torch.allclose(la[:, p], lb[:, p], atol=1e-4)


def test_step_k_at_position_t_reads_tokens_up_to_t_plus_k_only():
    draft = make_draft(6)
    aux, tokens = random_inputs(6)
    p = 4
    tokens2 = tokens.clone()
    tokens2[:, p] = (tokens[:, p] + 1) % TARGET_V
    with torch.no_grad():
        a, b = draft.unroll(aux, tokens, 3), draft.unroll(aux, tokens2, 3)
    for k in range(3):
        for t in range(6):
            same = torch.allclose(a[k][:, t], b[k][:, t], atol=1e-6)
            if t + k < p:
                assert same, (k, t)
            elif t + k == p:  # the step reads the changed token directly
                assert not same, (k, t)


def test_unroll_keeps_samples_of_a_batch_independent():
    draft = make_draft(7)
    aux, tokens = random_inputs(7, b=3)
    with torch.no_grad():
        whole = draft.unroll(aux, tokens, 3)
        for i in range(3):
            one = draft.unroll(aux[i:i + 1], tokens[i:i + 1], 3)
            for k in range(3):
                assert torch.allclose(whole[k][i:i + 1], one[k], atol=1e-5)


def test_unroll_is_invariant_to_a_constant_position_offset():
    draft = make_draft(8)
    aux, tokens = random_inputs(8)
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        a = draft.unroll(aux, tokens, 3)
        b = draft.unroll(aux, tokens, 3, pos + 9)
    for la, lb in zip(a, b):
        assert torch.allclose(la, lb, atol=1e-4)


# --------------------------------------------------------------------------------------
# ttt.py: shift, valid_mask, expected_accept_length, verifier_targets
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("s", [0, 1, 2, 4, 5])
@pytest.mark.parametrize("fill", [0, -1])
def test_shift_moves_dim1_left_by_s_and_fills_the_tail(s, fill):
    x = torch.arange(2 * 5 * 3).view(2, 5, 3)
    out = shift(x, s, fill)
    assert out.shape == x.shape
    for b in range(2):
        for t in range(5):
            for c in range(3):
                want = int(x[b, t + s, c]) if t + s < 5 else fill
                assert int(out[b, t, c]) == want


# A batch shorter than the unrolled steps (found by these tests: shift used to return a
# tensor of length s, and ttt_step_metrics failed to broadcast).
def test_shift_past_the_end_keeps_the_length_and_is_all_fill():
    x = torch.ones(2, 3)
    out = shift(x, 5, 7)
    assert out.shape == (2, 3)
    assert torch.equal(out, torch.full((2, 3), 7.0))


def test_ttt_step_metrics_handles_a_batch_shorter_than_the_unrolled_steps():
    draft = make_draft(9)
    g = torch.Generator().manual_seed(9)
    batch = {"input_ids": torch.randint(0, TARGET_V, (1, 3), generator=g),
             "loss_mask": torch.ones(1, 3, dtype=torch.uint8), "lengths": torch.tensor([3]),
             "aux_hidden": torch.randn(1, 3, 3 * TARGET_H, generator=g),
             "last_hidden": torch.randn(1, 3, TARGET_H, generator=g)}
    out = ttt_step_metrics(draft, batch, torch.randn(TARGET_V, TARGET_H), 3, 1.0)
    # t + 2 + k < 3 only for t = 0, k = 0
    assert [int(out[f"count_{k}"]) for k in range(3)] == [1, 0, 0]


def test_shift_zero_returns_the_input_itself():
    x = torch.randn(2, 4)
    assert shift(x, 0) is x


def test_valid_mask_follows_the_index_convention():
    g = torch.Generator().manual_seed(0)
    b, t = 3, 8
    loss_mask = torch.randint(0, 2, (b, t), generator=g, dtype=torch.uint8)
    lengths = torch.tensor([8, 5, 2])
    for i, n in enumerate(lengths.tolist()):
        loss_mask[i, n:] = 1  # padding marked trained must still be excluded by lengths
    for k in range(4):
        got = valid_mask(loss_mask, lengths, k)
        assert got.dtype == torch.bool
        for i in range(b):
            for p in range(t):
                j = p + 2 + k
                want = j < lengths[i] and bool(loss_mask[i, j])
                assert bool(got[i, p]) == want, (k, i, p)


def test_valid_mask_hand_example():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]])
    lengths = torch.tensor([6])
    # k=0: position t counts when t+2 < 6 and mask[t+2]: t=0 (mask[2]=1), t=1 (mask[3]=1),
    # t=2 (mask[4]=0), t=3 (mask[5]=1), t>=4 out of range
    assert valid_mask(loss_mask, lengths, 0).tolist() == [[1, 1, 0, 1, 0, 0, 0]]
    assert valid_mask(loss_mask, lengths, 1).tolist() == [[1, 0, 1, 0, 0, 0, 0]]


@pytest.mark.parametrize("accs,want", [
    ([], 1.0),
    ([0.5, 0.5], 1.0 + 0.5 + 0.25),
    ([1.0, 1.0, 1.0], 4.0),
    ([0.0, 1.0, 1.0], 1.0),
    ([0.8, 0.5, 0.25], 1 + 0.8 + 0.4 + 0.1),
])
def test_expected_accept_length_is_one_plus_sum_of_running_products(accs, want):
    got = expected_accept_length([torch.tensor(a, requires_grad=True) for a in accs])
    assert float(got) == pytest.approx(want)
    assert not got.requires_grad


def test_verifier_targets_greedy_over_full_vocab_and_logp_over_draft_vocab():
    g = torch.Generator().manual_seed(0)
    last = torch.randn(2, 3, TARGET_H, generator=g)
    head = torch.randn(TARGET_V, TARGET_H, generator=g)
    targets = vocab_maps(0)[0]
    for chunk in (1, 4, 2048):
        out = verifier_targets(last, head, targets, chunk=chunk)
        assert out["greedy"].shape == (2, 3) and out["logp"].shape == (2, 3, DRAFT_V)
        for b in range(2):
            for t in range(3):
                logits = [float(head[v].double() @ last[b, t].double()) for v in range(TARGET_V)]
                assert int(out["greedy"][b, t]) == max(range(TARGET_V), key=lambda v: logits[v])
                sub = [logits[int(v)] for v in targets]
                lse = math.log(sum(math.exp(z) for z in sub))
                for j, z in enumerate(sub):
                    assert float(out["logp"][b, t, j]) == pytest.approx(z - lse, abs=1e-4)


# --------------------------------------------------------------------------------------
# ttt_step_metrics and chain_acceptance
# --------------------------------------------------------------------------------------

def make_batch(seed: int, lengths: List[int], t: int, greedy: Optional[torch.Tensor] = None,
               loss_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """A collated-looking batch; with `greedy` [B, T] the last hidden states are one-hot, so
    an identity verifier head's greedy token at (b, t) is greedy[b, t]."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(1, TARGET_V, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * TARGET_H, generator=g)
    last = torch.randn(b, t, TARGET_H, generator=g)
    if greedy is not None:
        last = 3.0 * F.one_hot(greedy, TARGET_H).float()
    if loss_mask is None:
        loss_mask = torch.ones(b, t, dtype=torch.uint8)
    loss_mask = loss_mask.clone()
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        aux[i, n:] = 0
        last[i, n:] = 0
        loss_mask[i, n:] = 0
    return {"input_ids": ids, "loss_mask": loss_mask, "lengths": torch.tensor(lengths),
            "aux_hidden": aux, "last_hidden": last}


def test_ttt_step_metrics_matches_a_loop_reference():
    draft = make_draft(10)
    g = torch.Generator().manual_seed(10)
    mask = torch.randint(0, 2, (2, 7), generator=g, dtype=torch.uint8)
    batch = make_batch(10, [7, 5], 7, loss_mask=mask)
    head = torch.randn(TARGET_V, TARGET_H, generator=g)
    steps, w = 3, 0.7
    out = ttt_step_metrics(draft, batch, head, steps, w)

    ids, lengths, lm = batch["input_ids"], batch["lengths"], batch["loss_mask"]
    b, t = ids.shape
    # step k at t reads x[t+1+k] (0 past the end)
    tokens = torch.zeros(b, t + steps, dtype=torch.long)
    for i in range(b):
        for p in range(t + steps):
            tokens[i, p] = ids[i, p + 1] if p + 1 < t else 0
    logits = ref_unroll(draft, batch["aux_hidden"], tokens, steps)
    chosen = vocab_maps(10)[0].tolist()
    vl = batch["last_hidden"].double() @ head.double().T  # verifier logits [B, T, Vt]
    total = 0.0
    for k in range(steps):
        ce_sum, hits, n = 0.0, 0, 0
        for i in range(b):
            for p in range(t):
                j = p + 2 + k
                if not (j < lengths[i] and lm[i, j]):
                    continue
                n += 1
                v = vl[i, p + 1 + k]
                target = torch.log_softmax(v[chosen], 0).exp()
                ce_sum += float(-(target * torch.log_softmax(logits[k][i, p], 0)).sum())
                proposal = chosen[int(logits[k][i, p].argmax())]
                hits += proposal == int(v.argmax())
        assert int(out[f"count_{k}"]) == n
        assert float(out[f"loss_{k}"]) == pytest.approx(ce_sum / max(n, 1), rel=1e-4)
        assert float(out[f"acc_{k}"]) == pytest.approx(hits / max(n, 1))
        total += w ** k * ce_sum / max(n, 1)
    assert float(out["loss"].detach()) == pytest.approx(total, rel=1e-4)
    want_len = expected_accept_length([out[f"acc_{k}"] for k in range(steps)])
    assert float(out["accept_len"]) == pytest.approx(float(want_len))


def test_verifier_choice_counts_trained_positions_whose_next_token_the_verifier_would_write():
    # The verifier's greedy token after each position is chosen (one-hot last hidden states,
    # identity head): at some positions it is the data's next token, elsewhere not. The count
    # is held against a loop over the docstring's rule, on a masked, ragged batch.
    g = torch.Generator().manual_seed(21)
    lengths, t = [7, 5], 7
    mask = torch.randint(0, 2, (2, t), generator=g, dtype=torch.uint8)
    base = make_batch(21, lengths, t, loss_mask=mask)
    ids = base["input_ids"]
    greedy = torch.randint(1, TARGET_V, (2, t), generator=g)
    agree = torch.rand(2, t, generator=g) < 0.5
    greedy[:, :-1] = torch.where(agree[:, :-1], ids[:, 1:], greedy[:, :-1])  # the verifier
    batch = make_batch(21, lengths, t, greedy=greedy, loss_mask=mask)      # writes x[p+1] or not
    assert torch.equal(batch["input_ids"], ids)
    out = ttt_step_metrics(make_draft(21), batch, torch.eye(TARGET_V), 2, 1.0)
    want = n = 0
    for i, length in enumerate(lengths):
        for p in range(t):
            if p + 2 < length and mask[i, p + 2]:  # step 0 at p is trained
                n += 1
                want += int(greedy[i, p + 1]) == int(ids[i, p + 2])
    assert int(out["count_0"]) == n and 0 < want < n  # both cases are present
    assert int(out["verifier_choice"]) == want
    # the verifier's own text: every trained position reads its choice
    own = make_batch(21, lengths, t, greedy=torch.cat([ids[:, 1:], ids[:, :1]], 1), loss_mask=mask)
    own["input_ids"] = ids
    assert int(ttt_step_metrics(make_draft(21), own, torch.eye(TARGET_V), 2, 1.0)["verifier_choice"]) == n


def uniform_draft(seed: int) -> Eagle3Draft:
    """A draft whose logits are all zero: it always proposes draft id 0."""
    draft = make_draft(seed)
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    return draft


def test_ttt_step_metrics_uniform_draft_agreeing_with_verifier():
    draft = uniform_draft(11)
    first = int(vocab_maps(11)[0][0])  # the target id of draft id 0
    lengths = [6, 4]
    batch = make_batch(11, lengths, 6, greedy=torch.full((2, 6), first))
    steps, w = 3, 0.5
    out = ttt_step_metrics(draft, batch, torch.eye(TARGET_V), steps, w)
    # count_k = sum over samples of max(len - 2 - k, 0): [4+2, 3+1, 2+0]
    assert [int(out[f"count_{k}"]) for k in range(steps)] == [6, 4, 2]
    # uniform draft distribution: soft cross-entropy is log(|draft vocab|) whatever the target
    for k in range(steps):
        assert float(out[f"loss_{k}"]) == pytest.approx(math.log(DRAFT_V), rel=1e-5)
        assert float(out[f"acc_{k}"]) == 1.0
    assert float(out["loss"].detach()) == pytest.approx(math.log(DRAFT_V) * (1 + 0.5 + 0.25), rel=1e-5)
    assert float(out["accept_len"]) == pytest.approx(1 + steps)


def test_ttt_step_metrics_uniform_draft_disagreeing_with_verifier():
    draft = uniform_draft(12)
    chosen = vocab_maps(12)[0].tolist()
    other = next(v for v in range(TARGET_V) if v != chosen[0])
    batch = make_batch(12, [6, 6], 6, greedy=torch.full((2, 6), other))
    out = ttt_step_metrics(draft, batch, torch.eye(TARGET_V), 2, 1.0)
    assert float(out["acc_0"]) == 0.0 and float(out["acc_1"]) == 0.0
    assert float(out["accept_len"]) == 1.0
    assert float(out["loss"].detach()) == pytest.approx(2 * math.log(DRAFT_V), rel=1e-5)


def test_ttt_step_metrics_with_nothing_trained_gives_zero_loss_and_counts():
    draft = make_draft(13)
    batch = make_batch(13, [6, 3], 6, loss_mask=torch.zeros(2, 6, dtype=torch.uint8))
    out = ttt_step_metrics(draft, batch, torch.eye(TARGET_V), 2, 0.8)
    for k in range(2):
        assert int(out[f"count_{k}"]) == 0
        assert float(out[f"loss_{k}"]) == 0.0 and float(out[f"acc_{k}"]) == 0.0
    assert float(out["loss"].detach()) == 0.0


def test_ttt_loss_trains_the_draft_but_not_the_verifier_head():
    draft = make_draft(14).train()
    batch = make_batch(14, [6, 5], 6)
    head = torch.randn(TARGET_V, TARGET_H, requires_grad=True)
    out = ttt_step_metrics(draft, batch, head, 2, 0.8)
    out["loss"].backward()
    assert head.grad is None
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    assert draft.lm_head.weight.grad.abs().sum() > 0
    assert not out["loss_0"].requires_grad and not out["acc_0"].requires_grad


def test_chain_acceptance_counts_in_range_steps_when_the_verifier_always_agrees():
    draft = uniform_draft(15)
    first = int(vocab_maps(15)[0][0])
    lengths, t, depth = [7, 5], 7, 3
    mask = torch.ones(2, t, dtype=torch.uint8)
    mask[0, 4] = 0  # start t=2 of sample 0 is not trained: no chain there
    batch = make_batch(15, lengths, t, greedy=torch.full((2, t), first), loss_mask=mask)
    out = chain_acceptance(draft, batch, torch.eye(TARGET_V), depth)
    for i, n in enumerate(lengths):
        for p in range(t):
            start = p + 2 < n and bool(batch["loss_mask"][i, p + 2])
            assert bool(out["valid"][i, p]) == start
            # step k stays in range while p + 2 + k < n
            want = min(depth, n - 2 - p) if start else 0
            assert int(out["accepted"][i, p]) == want, (i, p)


def test_chain_acceptance_accepts_nothing_when_the_verifier_never_agrees():
    draft = uniform_draft(16)
    chosen = vocab_maps(16)[0].tolist()
    other = next(v for v in range(TARGET_V) if v != chosen[0])
    batch = make_batch(16, [6, 6], 6, greedy=torch.full((2, 6), other))
    out = chain_acceptance(draft, batch, torch.eye(TARGET_V), 3)
    assert int(out["accepted"].sum()) == 0
    assert int(out["valid"].sum()) == 8


def test_chain_acceptance_matches_a_reference_that_feeds_the_drafts_own_proposals():
    draft = make_draft(17)
    chosen = vocab_maps(17)[0].tolist()
    lengths, t, depth = [8, 6], 8, 3
    base = make_batch(17, lengths, t)
    # proposals of step 0 come from the real tokens; make the verifier agree with the step-0
    # proposal at every other position so acceptance is neither all nor nothing
    ref = RefDraft(draft, base["aux_hidden"])
    tok0 = torch.cat([base["input_ids"][:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    prop0 = ref.step(tok0).argmax(-1)
    g = torch.Generator().manual_seed(17)
    greedy = torch.randint(0, TARGET_V, (2, t), generator=g)
    for i in range(2):
        for p in range(0, t - 1, 2):
            greedy[i, p + 1] = chosen[int(prop0[i, p])]
    batch = make_batch(17, lengths, t, greedy=greedy)
    greedy = batch["last_hidden"].argmax(-1)  # padding rows are all zero: argmax 0

    out = chain_acceptance(draft, batch, torch.eye(TARGET_V), depth)

    ref = RefDraft(draft, batch["aux_hidden"])
    tokens = tok0
    proposals = []
    for k in range(depth):
        tokens = torch.tensor(chosen)[ref.step(tokens).argmax(-1)]
        proposals.append(tokens)
    for i, n in enumerate(lengths):
        for p in range(t):
            want = 0
            if p + 2 < n and batch["loss_mask"][i, p + 2]:
                for k in range(depth):
                    if p + 2 + k < n and int(proposals[k][i, p]) == int(greedy[i, p + 1 + k]):
                        want += 1
                    else:
                        break
            assert int(out["accepted"][i, p]) == want, (i, p)
    assert int(out["accepted"].sum()) > 0


def test_chain_acceptance_at_depth_one_agrees_with_step_zero_accuracy():
    draft = make_draft(18)
    g = torch.Generator().manual_seed(18)
    head = torch.randn(TARGET_V, TARGET_H, generator=g)
    batch = make_batch(18, [7, 6], 7)
    acc = ttt_step_metrics(draft, batch, head, 1, 1.0)
    chain = chain_acceptance(draft, batch, head, 1)
    n = int(chain["valid"].sum())
    assert n == int(acc["count_0"])
    assert float(chain["accepted"].sum()) / n == pytest.approx(float(acc["acc_0"]))
