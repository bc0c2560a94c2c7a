"""Compact hidden-state storage (data/compact.py) and training from it (draft/ttt.py).

Pure logic, in-process: quantization error bounds from the formats' definitions, the
top-k teacher against the verifier's own log-softmax, and training on a top-k teacher
that keeps the whole vocabulary equal to training on the last hidden state.
"""

from __future__ import annotations

import pytest
import torch

from eagle3x.data import compact
from eagle3x.draft.ttt import draft_index, topk_distribution, ttt_step_metrics
from tests.draft.test_linear_memory import draft_and_batch, grads


def states(t: int = 40, h: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 3 * h, generator=g)
    x[:, h + 3] *= 80  # one massive channel in the middle layer, as real verifiers have
    return x


def per_layer(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], 3, -1)


# fp8 e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; int8
# rounds to the nearest of 127 steps of amax.
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_each_value_is_within_half_a_step_of_its_token_layers_scale(kind):
    x = states()
    q = compact.quantize(x, kind)
    assert q["aux_q"].dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind]
    assert q["aux_scale"].shape == (40, 3) and q["aux_scale"].dtype == torch.float32
    y = compact.dequantize(q["aux_q"], q["aux_scale"])
    err = per_layer(y - x).abs()
    amax = per_layer(x).abs().amax(-1, keepdim=True)
    if kind == "fp8":
        bound = 2 ** -4 * per_layer(x).abs() + amax / 448 * 2 ** -9  # + the subnormal step
    else:
        bound = amax / 127 / 2 * (1 + 1e-5)
    assert (err <= bound).all()
    assert torch.equal(q["aux_scale"], per_layer(x).abs().amax(-1) / compact.QMAX[kind])


def test_a_scale_per_layer_keeps_one_layers_outlier_from_costing_the_others():
    """int8 steps are uniform: one scale for the token's three layers would round layer 0
    in steps of the middle layer's outlier. (fp8's error is relative to each value, so
    its scale matters only near the ends of its range.)"""
    kind = "int8"
    x = states()
    q = compact.quantize(x, kind)
    y = compact.dequantize(q["aux_q"], q["aux_scale"])
    one = compact.quantize(x, kind, layers=1)  # one scale for the token's three layers
    z = compact.dequantize(one["aux_q"], one["aux_scale"])

    def rel(a):
        return float((per_layer(a - x)[:, 0]).norm() / per_layer(x)[:, 0].norm())

    assert rel(y) < 0.02 and rel(z) > 5 * rel(y)


def test_topk_teacher_is_the_verifiers_log_softmax_highest_first_greedy_first():
    g = torch.Generator().manual_seed(1)
    last, head = torch.randn(30, 16, generator=g), torch.randn(50, 16, generator=g)
    got = compact.topk_teacher(last, head, k=8, chunk=7)
    lp = torch.log_softmax(last @ head.T, -1)
    assert got["topk_ids"].dtype == torch.int32 and got["topk_logp"].dtype == torch.float16
    assert torch.equal(got["topk_ids"][:, 0].long(), lp.argmax(-1))
    assert (got["topk_logp"][:, :-1] >= got["topk_logp"][:, 1:]).all()
    want = lp.gather(1, got["topk_ids"].long())
    assert torch.allclose(got["topk_logp"].float(), want, atol=1e-2, rtol=1e-3)
    assert torch.equal(lp.topk(8).indices, got["topk_ids"].long())


def test_encode_then_decode_gives_what_training_reads_in_each_format():
    x, last = states(t=5, h=8), torch.randn(5, 8)
    head = torch.randn(20, 8)
    for aux in ("native", "fp8", "int8"):
        for teacher in ("hidden", "topk"):
            fmt = {"aux": aux, "teacher": teacher, "topk": 4}
            stored = compact.encode(x, last, fmt, torch.bfloat16, head)
            assert set(stored) == set(compact.keys(fmt))
            got = compact.decode(stored)
            assert got["aux_hidden"].shape == x.shape
            assert ("last_hidden" in got) == (teacher == "hidden")
            assert ("topk_ids" in got) == (teacher == "topk")


def test_bytes_per_token_counts_every_stored_byte():
    h, k = 4096, 64
    assert compact.baseline_bytes_per_token(h) == 8 * h + 5
    x = states(t=10, h=h // 64)
    for fmt in ({"aux": "fp8", "teacher": "topk", "topk": k},
                {"aux": "native", "teacher": "hidden"}):
        stored = compact.encode(x, torch.randn(10, h // 64), fmt, torch.bfloat16,
                                torch.randn(300, h // 64))
        per = sum(v.numel() * v.element_size() for v in stored.values()) / 10
        assert per + compact.ID_MASK_BYTES == compact.bytes_per_token(h // 64, 2, fmt)
    assert compact.bytes_per_token(h, 2, {"aux": "fp8", "teacher": "topk", "topk": k}) \
        <= 0.4 * compact.baseline_bytes_per_token(h)


def test_topk_distribution_keeps_the_draft_vocab_entries_renormalised():
    draft, _, _ = draft_and_batch(0, 8, [8])
    index = draft_index(draft)
    inside = (torch.arange(draft.shape.draft_vocab_size) + draft.d2t)
    outside = torch.tensor([i for i in range(draft.t2d.numel()) if not draft.t2d[i]])
    ids = torch.stack([inside[:3], torch.cat([inside[3:4], outside[:2]]), outside[:3]])
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.4, 0.3, 0.2], [0.5, 0.3, 0.1]]))
    p = topk_distribution(ids, logp, index, draft.shape.draft_vocab_size)
    assert torch.allclose(p[0, :3], torch.tensor([0.625, 0.25, 0.125]))
    assert p[1, 3] == 1 and p[1].sum() == 1
    assert p[2].sum() == 0  # nothing of the top-k inside the draft vocab: no target


@pytest.mark.parametrize("chunk,capped", [(2048, False), (5, False), (2048, True), (5, True)])
def test_a_topk_teacher_over_the_whole_vocabulary_trains_like_the_last_hidden_state(chunk,
                                                                                  capped):
    """Also with a Gemma-style soft-cap after the lm_head (at half the largest logit: it
    bends the distribution without saturating ties), written out here from its
    definition (cap * tanh(logits / cap)) for the top-k side."""
    draft, batch, head = draft_and_batch(3, 12, [12, 9])
    softcap = float((batch["last_hidden"] @ head.T).abs().max()) / 2 if capped else None
    want = ttt_step_metrics(draft, batch, head, 3, 0.8, chunk=chunk, softcap=softcap)
    g_want = grads(draft, want["loss"])
    logits = batch["last_hidden"] @ head.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
        plain = ttt_step_metrics(draft, batch, head, 3, 0.8, chunk=chunk)
        assert not torch.allclose(plain["loss"], want["loss"], atol=1e-3)
    lp = torch.log_softmax(logits, -1)
    v, i = lp.topk(head.shape[0], -1)
    topk = {k: x for k, x in batch.items() if k != "last_hidden"}
    topk.update(topk_ids=i.to(torch.int32), topk_logp=v)
    got = ttt_step_metrics(draft, topk, head, 3, 0.8, chunk=chunk, softcap=softcap)
    g_got = grads(draft, got["loss"])
    for k in range(3):
        assert torch.allclose(got[f"loss_{k}"], want[f"loss_{k}"], atol=1e-5), k
        assert torch.equal(got[f"acc_{k}"], want[f"acc_{k}"]), k
    for name in g_want:
        assert torch.allclose(g_got[name], g_want[name], atol=1e-5), name


def test_a_truncated_teacher_changes_the_loss_but_not_the_accuracy():
    draft, batch, head = draft_and_batch(4, 12, [12, 10])
    want = ttt_step_metrics(draft, batch, head, 2, 0.8)
    lp = torch.log_softmax(batch["last_hidden"] @ head.T, -1)
    v, i = lp.topk(4, -1)
    topk = {k: x for k, x in batch.items() if k != "last_hidden"}
    topk.update(topk_ids=i.to(torch.int32), topk_logp=v.half())
    got = ttt_step_metrics(draft, topk, head, 2, 0.8)
    assert not torch.allclose(got["loss"], want["loss"])
    for k in range(2):
        assert torch.equal(got[f"acc_{k}"], want[f"acc_{k}"])  # greedy = topk_ids[..., 0]
