"""The fused training-time-test attention (eagle3x/draft/attention.py) against the softmax it
computes, written out densely here in float64: values and gradients of q, every step's keys
and values, with grouped-query heads, packed documents and 0..3 later steps. The CUDA
variable-length path runs here through a stand-in for aten's flash kernels that keeps
their contract (shapes and the [heads, total] logsumexp of FlashAttention-2's varlen
kernel, as torch's meta registration for `_flash_attention_forward` declares it), so the
layout handling around the kernel is tested on the CPU; the kernel itself only on a GPU
(bench/gpu_check.py compares the two paths there).
"""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from eagle3x.draft import attention
from eagle3x.draft.attention import (cu_seqlens_from_docs, fused_reason, fused_ttt_attention,
                                     rows_cu_seqlens)


def dense(q, cache, scale: float, docs: Optional[torch.Tensor] = None,
          window: Optional[int] = None) -> torch.Tensor:
    """softmax(q . [causal step-0 keys of the same document | same-position keys of later
    steps]) @ values, token-major [B, T, h, D], in float64 with explicit masks; with a
    `window` of W positions a query n steps on sees the step-0 keys of the last W - n."""
    q = q.double()
    b, t, h, d = q.shape
    kvh = cache[0][0].shape[2]

    def heads(x):  # [B, T, kvh, D] -> [B, h, T, D], kv head i // (h / kvh) per query head
        return x.double().transpose(1, 2).repeat_interleave(h // kvh, 1)

    qh = q.transpose(1, 2)
    k0, v0 = heads(cache[0][0]), heads(cache[0][1])
    allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(b, 1, t, t)
    if window is not None:  # the query's real position is len(cache) - 1 steps on
        back = window - len(cache)
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).triu(-back)
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    scores = [(qh @ k0.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    later = cache[1:]
    if later:
        scores.append(torch.stack([(qh * heads(kj)).sum(-1) * scale for kj, _ in later], -1))
    p = torch.softmax(torch.cat(scores, -1), -1)
    out = p[..., :t] @ v0
    for j, (_, vj) in enumerate(later):
        out = out + p[..., t + j, None] * heads(vj)
    return out.transpose(1, 2)


def inputs(seed: int, b: int, t: int, h: int, kvh: int, steps: int, d: int = 8,
           dtype=torch.float32) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    kv = [torch.randn(b, t, kvh, d, generator=g) for _ in range(2 * (steps + 1))]
    return [x.to(dtype).requires_grad_() for x in [q, *kv]]


def as_cache(xs: List[torch.Tensor]):
    q, rest = xs[0], xs[1:]
    return q, [(rest[2 * i], rest[2 * i + 1]) for i in range(len(rest) // 2)]


def packed_docs(b: int, t: int, seed: int) -> torch.Tensor:
    """Document ids per row: random cuts, and a padding tail (-1) on the first row."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        cuts = sorted(torch.randperm(t - 1, generator=g)[:3].add(1).tolist())
        for i, c in enumerate(cuts):
            docs[r, c:] = i + 1
    docs[0, t - 4:] = -1
    return docs


def check_against_dense(xs, docs, cu, rel: float = 1e-5, window: Optional[int] = None) -> None:
    q, cache = as_cache(xs)
    scale = q.shape[-1] ** -0.5
    got = fused_ttt_attention(q, cache, scale, cu, window)
    want = dense(q, cache, scale, docs, window)
    assert (got.double() - want).abs().max() <= rel * want.abs().max(), \
        (got.double() - want).abs().max()
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = torch.autograd.grad(got, xs, g.to(got.dtype))
    refs = torch.autograd.grad(want, xs, g)
    for i, (a, r) in enumerate(zip(grads, refs)):
        scale_r = r.abs().max().clamp(min=1e-6)
        assert (a.double() - r).abs().max() <= rel * scale_r, (i, (a.double() - r).abs().max())


@pytest.mark.parametrize("h,kvh", [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_fused_attention_gives_the_dense_softmax_and_its_gradients(h, kvh, steps):
    check_against_dense(inputs(1, 2, 23, h, kvh, steps), None, None)


@pytest.mark.parametrize("steps", [0, 2])
def test_packed_documents_see_only_themselves(steps):
    docs = packed_docs(2, 29, seed=4)
    check_against_dense(inputs(2, 2, 29, 4, 2, steps), docs, cu_seqlens_from_docs(docs))


def test_a_position_never_reads_a_later_position_or_another_document():
    xs = inputs(3, 1, 20, 2, 1, 1)
    docs = packed_docs(1, 20, seed=5)
    q, cache = as_cache(xs)
    out = fused_ttt_attention(q, cache, 0.3, cu_seqlens_from_docs(docs))
    t = 11
    grads = torch.autograd.grad(out[0, t].sum(), [cache[0][0], cache[0][1]])
    reached = (grads[0][0].abs().sum((1, 2)) + grads[1][0].abs().sum((1, 2))) > 0
    allowed = (torch.arange(20) <= t) & (docs[0] == docs[0, t])
    assert torch.equal(reached, allowed)


def test_segments_from_docs_cut_rows_documents_and_padding_tails():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    assert cu_seqlens_from_docs(docs).tolist() == [0, 2, 5, 6, 12]
    assert rows_cu_seqlens(2, 6, torch.device("cpu")).tolist() == [0, 6, 12]


def test_collate_packed_gives_the_segments_the_fused_kernel_reads():
    from eagle3x.data.datamodule import collate_packed

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 9, (n,), generator=g),
                "loss_mask": torch.ones(n, dtype=torch.uint8)} for n in (7, 3, 2, 6, 4)]
    for width in (None, 16):
        batch = collate_packed(samples, width=width)
        assert torch.equal(batch["cu_seqlens"], cu_seqlens_from_docs(batch["docs"]))


class VarlenStandIn:
    """aten's `_flash_attention_forward` / `_backward` in their variable-length form, as
    their contract reads (torch/_meta_registrations.py meta__flash_attention_forward;
    FlashAttention-2 mha_varlen_fwd / mha_varlen_bwd): 3-D q [total, h, D], k and v
    [total, kv heads, D], int32 cumulative offsets, `max_q`/`max_k` at least every
    segment's length, causal within each segment; out [total, h, D] and the logsumexp
    [h, total] float32. Computed per segment with the CPU flash kernel."""

    calls = 0

    @staticmethod
    def _check(q, k, cu, max_q):
        assert q.dim() == 3 and k.dim() == 3 and q.shape[1] % k.shape[1] == 0
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == q.shape[0]
        assert int((cu[1:] - cu[:-1]).max()) <= max_q

    @staticmethod
    def _windowed(q, k, v, cu, scale, left):
        """Causal attention within `left` positions back, per segment, float64 (the kernel's
        window_size_left): (out, lse [h, total])."""
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
        rep = q.shape[1] // k.shape[1]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs = q[s:e].double().transpose(0, 1)
            ks = k[s:e].double().transpose(0, 1).repeat_interleave(rep, 0)
            vs = v[s:e].double().transpose(0, 1).repeat_interleave(rep, 0)
            n = e - s
            mask = torch.ones(n, n, dtype=torch.bool).tril() & torch.ones(n, n, dtype=torch.bool).triu(-left)
            sc = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            lse[:, s:e] = torch.logsumexp(sc, -1)
            out[s:e] = (torch.softmax(sc, -1) @ vs).transpose(0, 1)
        return out, lse

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, scale=None, window_size_left=None,
                                 window_size_right=None):
        self._check(q, k, cu_q, max_q)
        assert torch.equal(cu_q, cu_k) and is_causal and dropout_p == 0.0
        type(self).calls += 1
        if window_size_left is not None:
            assert window_size_left >= 0 and window_size_right == 0
            out, lse = self._windowed(q, k, v, cu_q, scale, window_size_left)
            return out.to(q.dtype), lse.float(), torch.zeros(2), torch.zeros(()), torch.empty(0)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            o, l_ = op(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), 0.0, True,
                       scale=scale)
            out[s:e] = o[0].transpose(0, 1)
            lse[:, s:e] = l_[0]
        return out, lse, torch.zeros(2), torch.zeros(()), torch.empty(0)

    def _flash_attention_backward(self, g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                  dropout_p, is_causal, rng, unused, scale=None,
                                  window_size_left=None, window_size_right=None):
        self._check(q, k, cu_q, max_q)
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        if window_size_left is not None:  # the kernel's backward: P from the given lse
            rep = q.shape[1] // k.shape[1]
            dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
            for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
                n = e - s
                qs, gs, os_ = (x[s:e].double().transpose(0, 1) for x in (q, g, out))
                ks = k[s:e].double().transpose(0, 1).repeat_interleave(rep, 0)
                vs = v[s:e].double().transpose(0, 1).repeat_interleave(rep, 0)
                mask = (torch.ones(n, n, dtype=torch.bool).tril()
                        & torch.ones(n, n, dtype=torch.bool).triu(-window_size_left))
                sc = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
                prob = torch.exp(sc - lse[:, s:e, None].double())
                dp = gs @ vs.transpose(-1, -2)
                ds = prob * (dp - (gs * os_).sum(-1, keepdim=True))
                dq[s:e] = (ds @ ks * scale).transpose(0, 1)
                dks = (ds.transpose(-1, -2) @ qs * scale).view(k.shape[1], rep, n, -1).sum(1)
                dvs = (prob.transpose(-1, -2) @ gs).view(k.shape[1], rep, n, -1).sum(1)
                dk[s:e], dv[s:e] = dks.transpose(0, 1), dvs.transpose(0, 1)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            parts = [x[s:e].transpose(0, 1)[None] for x in (g, q, k, v, out)]
            d = op(*parts, lse[None, :, s:e].contiguous(), 0.0, True, scale=scale)
            for gr, di in zip(grads, d):
                gr[s:e] = di[0].transpose(0, 1)
        return tuple(grads)


@pytest.mark.parametrize("packed", [False, True])
def test_the_cuda_path_lays_tensors_out_as_the_varlen_kernel_takes_them(monkeypatch, packed):
    monkeypatch.setattr(attention, "VARLEN_OPS", VarlenStandIn())
    monkeypatch.setattr(attention, "uses_varlen", lambda q: True)
    VarlenStandIn.calls = 0
    docs = packed_docs(2, 26, seed=6) if packed else None
    cu = cu_seqlens_from_docs(docs) if packed else None
    check_against_dense(inputs(5, 2, 26, 4, 2, 2), docs, cu)
    assert VarlenStandIn.calls == 1  # every segment of the batch in one kernel call


@pytest.mark.parametrize("window,steps", [(4, 0), (4, 2), (3, 3), (2, 3)])
def test_the_cuda_paths_sliding_window_sees_the_last_w_positions_of_the_real_query(
        monkeypatch, window, steps):
    """A query n steps on sits n positions further: its window holds its n drafted keys
    and the last W - n step-0 keys (none when n >= W)."""
    monkeypatch.setattr(attention, "VARLEN_OPS", VarlenStandIn())
    monkeypatch.setattr(attention, "uses_varlen", lambda q: True)
    docs = packed_docs(2, 21, seed=8)
    check_against_dense(inputs(9, 2, 21, 4, 2, steps), docs, cu_seqlens_from_docs(docs),
                        window=window)


def test_the_cpu_kernel_refuses_a_sliding_window():
    q, cache = as_cache(inputs(10, 1, 8, 2, 1, 1))
    with pytest.raises(RuntimeError, match="sliding window"):
        fused_ttt_attention(q, cache, 0.3, None, 4)
    assert "sliding window" in fused_reason(torch.device("cpu"), torch.float32, 64, 4)


def test_bfloat16_on_the_cpu_stays_within_bfloat16_rounding_of_the_dense_softmax():
    xs = inputs(7, 2, 31, 4, 2, 3, d=16, dtype=torch.bfloat16)
    q, cache = as_cache(xs)
    got = fused_ttt_attention(q, cache, 0.25)
    want = dense(q, cache, 0.25)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def test_which_devices_and_dtypes_have_a_fused_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_reason(cpu, torch.float32, 64) is None
    assert fused_reason(cpu, torch.bfloat16, 64) is None
    assert "float16" in fused_reason(cpu, torch.float16, 64)
    assert fused_reason(cuda, torch.bfloat16, 128) is None
    assert "bf16-mixed" in fused_reason(cuda, torch.float32, 128)
    assert "head_dim" in fused_reason(cuda, torch.bfloat16, 320)
    assert fused_reason(torch.device("meta"), torch.float32, 64) is not None


def test_the_device_check_sends_a_kernel_that_computes_something_else_to_the_reference(
        monkeypatch):
    """Once per GPU and shape the fused kernel is held to the dense softmax; a kernel that
    is off (or fails) is reported, and Attention.uses_fused then takes the reference."""
    class Off(VarlenStandIn):
        def _flash_attention_forward(self, *a, **kw):
            out, *rest = super()._flash_attention_forward(*a, **kw)
            return (out * 1.1, *rest)

    monkeypatch.setattr(attention, "uses_varlen", lambda q: True)
    cpu = torch.device("cpu")
    monkeypatch.setattr(attention, "VARLEN_OPS", VarlenStandIn())
    assert attention._device_check(cpu, torch.float32, 4, 2, 16, None) is None
    assert attention._device_check(cpu, torch.float32, 4, 2, 16, 5) is None
    monkeypatch.setattr(attention, "VARLEN_OPS", Off())
    assert "off the dense softmax" in attention._device_check(cpu, torch.float32, 4, 2, 16, None)
    monkeypatch.setattr(attention, "VARLEN_OPS", object())
    assert "failed" in attention._device_check(cpu, torch.float32, 4, 2, 16, None)
