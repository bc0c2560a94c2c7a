"""Training-time-test attention through a fused attention kernel.

Step k of the training-time test attends from every position t to the step-0 keys of
positions 0..t (causal, within t's document) and to the keys of steps 1..k at t itself
(the chain a drafted token extends). `ttt_attention` in model.py computes that as one
dense score matrix per block; this module computes it with the attention kernel of the
device, which keeps nothing T x T:

    (out0, lse0) = causal attention over the step-0 keys, per document (flash kernel)
    s_j          = q . k_j * scale                         the same-position terms, j = 1..k
    L            = logaddexp(lse0, logsumexp_j s_j)        the whole softmax's normaliser
    out          = exp(lse0 - L) * out0 + sum_j exp(s_j - L) * v_j

Backward: the kernel's own backward, handed the merged `out` and the merged `L`, returns
the exact gradients of the causal block (it recomputes P = exp(S0 - L), which is the
merged softmax's causal part, and uses D = rowsum(dO * out) of the merged output); the
same-position terms are differentiated here. So the result is the dense computation's to
rounding (tests/draft/test_attention.py holds it to the dense reference in float32,
values and gradients) at the kernel's speed and memory.

Kernels (`fused_reason` says why one cannot run):
  CPU:  aten ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), float32
        or bfloat16, grouped-query heads natively; documents of packed rows one call each.
  CUDA: aten ``_flash_attention_forward`` / ``_flash_attention_backward`` in their
        variable-length form (the kernels behind SDPA's flash backend and
        torch.nn.attention.varlen): bfloat16 / float16, head_dim <= 256, every document
        of the batch in one call through cumulative sequence offsets (`cu_seqlens`), so
        packed rows cost their documents' attention, not the row's.
Layout: token-major, q [B, T, heads, D], k and v [B, T, kv heads, D]; lse [B, T, heads].
`cu_seqlens` (int32 [S+1]) cuts the B*T flattened positions into segments (documents,
each row's padding tail); None means each row is one causal sequence.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def fused_reason(device: torch.device, dtype: torch.dtype, head_dim: int,
                 window: Optional[int] = None) -> Optional[str]:
    """Why the fused kernel cannot run for this device / dtype / head size / sliding
    window (None: it can)."""
    if device.type == "cpu":
        if window is not None:
            return "the CPU flash kernel has no sliding window"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the CPU flash kernel takes float32 or bfloat16, not {dtype}"
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            return "this torch has no CPU flash-attention backward"
        return None
    if device.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16):
            return (f"the CUDA flash kernel takes bfloat16 or float16, not {dtype} "
                    "(train with trainer.precision=bf16-mixed)")
        if head_dim > 256 or head_dim % 8:
            return f"the CUDA flash kernel takes head_dim <= 256 and a multiple of 8, not {head_dim}"
        if not hasattr(torch.ops.aten, "_flash_attention_backward"):
            return "this torch has no flash-attention kernel"
        return None
    return f"no fused attention kernel for device type {device.type!r}"


_CHECKED: dict = {}


def device_check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int, window: Optional[int] = None) -> Optional[str]:
    """Why the fused kernel is not used on this CUDA device (None: it is): once per device
    and shape, a small random problem (two documents, three steps) runs through it,
    forward and backward, against the dense softmax in float32; an error, or a relative
    error past bf16 rounding, sends training to the reference path instead of a silent
    wrong result (the CPU kernel is held to the dense one by the test suite; the CUDA
    kernel only here and in bench/gpu_check.py)."""
    key = (str(device), dtype, heads, kv_heads, head_dim, window)
    if key not in _CHECKED:
        _CHECKED[key] = _device_check(device, dtype, heads, kv_heads, head_dim, window)
    return _CHECKED[key]


def _device_check(device, dtype, heads, kv_heads, head_dim, window) -> Optional[str]:
    g = torch.Generator().manual_seed(0)
    t, steps = 96, 3
    x = [torch.randn(1, t, heads if i == 0 else kv_heads, head_dim, generator=g)
         for i in range(1 + 2 * (steps + 1))]
    docs = torch.zeros(1, t, dtype=torch.long)
    docs[0, 40:] = 1
    scale = head_dim ** -0.5
    try:
        with torch.autocast(device.type, enabled=False):
            xs = [a.to(device, dtype).requires_grad_() for a in x]
            cache = [(xs[1 + 2 * i], xs[2 + 2 * i]) for i in range(steps + 1)]
            out = fused_ttt_attention(xs[0], cache, scale,
                                      cu_seqlens_from_docs(docs.to(device)), window)
            grads = torch.autograd.grad(out.float().square().sum(), xs)
    except Exception as exc:  # a kernel this torch or GPU does not have
        return f"the fused kernel failed on {device} ({type(exc).__name__}: {exc})"[:400]
    ref = [a.double().requires_grad_() for a in x]
    want = _dense(ref[0], [(ref[1 + 2 * i], ref[2 + 2 * i]) for i in range(steps + 1)],
                  scale, docs, window)
    want_grads = torch.autograd.grad(want.square().sum(), ref)
    errs = [float((a.detach().double().cpu() - b.detach()).norm()
                  / b.detach().norm().clamp(min=1e-12))
            for a, b in zip([out, *grads], [want, *want_grads])]
    if max(errs) > 3e-2:
        return f"the fused kernel on {device} is {max(errs):.1e} off the dense softmax"
    return None


def _dense(q, cache, scale, docs, window):
    """The dense training-time-test softmax, token-major (the device check's reference)."""
    b, t, h, _ = q.shape
    rep = h // cache[0][0].shape[2]

    def heads(x):
        return x.transpose(1, 2).repeat_interleave(rep, 1)

    qh = q.transpose(1, 2)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).triu(-(window - len(cache)))
    allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    scores = [(qh @ heads(cache[0][0]).transpose(-1, -2) * scale).masked_fill(~allowed,
                                                                              float("-inf"))]
    if len(cache) > 1:
        scores.append(torch.stack([(qh * heads(k)).sum(-1) * scale for k, _ in cache[1:]], -1))
    p = torch.softmax(torch.cat(scores, -1), -1)
    out = p[..., :t] @ heads(cache[0][1])
    for j, (_, v) in enumerate(cache[1:]):
        out = out + p[..., t + j, None] * heads(v)
    return out.transpose(1, 2)


def cu_seqlens_from_docs(docs: torch.Tensor) -> torch.Tensor:
    """Segment offsets (int32 [S+1]) over the flattened [B, T] positions from document ids
    (packed rows; -1 marks padding): a new segment wherever a row starts or its document
    id changes."""
    b, t = docs.shape
    start = torch.ones_like(docs, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = start.flatten().nonzero().squeeze(1)
    end = torch.tensor([b * t], device=docs.device)
    return torch.cat([first, end]).to(torch.int32)


def rows_cu_seqlens(b: int, t: int, device: torch.device) -> torch.Tensor:
    """Segment offsets when each of the b rows of length t is one causal sequence."""
    return torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- kernels

def _cpu_causal(q, k, v, scale: float, bounds: Optional[List[int]]):
    """(out [B,T,h,D], lse [B,T,h] float32) of causal attention within each segment."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if bounds is None:
        o, lse = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True,
                    scale=scale)
        return o.transpose(1, 2), lse.transpose(1, 2)
    b, t = q.shape[:2]
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for s, e in zip(bounds[:-1], bounds[1:]):
        r, a = divmod(s, t)
        z = a + (e - s)
        o, l_ = op(q[r:r + 1, a:z].transpose(1, 2), k[r:r + 1, a:z].transpose(1, 2),
                   v[r:r + 1, a:z].transpose(1, 2), 0.0, True, scale=scale)
        out[r, a:z] = o[0].transpose(0, 1)
        lse[r, a:z] = l_[0].transpose(0, 1)
    return out, lse


def _cpu_causal_backward(g, q, k, v, out, lse, scale: float, bounds: Optional[List[int]]):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if bounds is None:
        dq, dk, dv = op(g.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                        v.transpose(1, 2), out.transpose(1, 2),
                        lse.transpose(1, 2).contiguous(), 0.0, True, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    t = q.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in zip(bounds[:-1], bounds[1:]):
        r, a = divmod(s, t)
        z = a + (e - s)
        gi, qi, ki, vi, oi = (x[r:r + 1, a:z].transpose(1, 2) for x in (g, q, k, v, out))
        li = lse[r:r + 1, a:z].transpose(1, 2).contiguous()
        dqi, dki, dvi = op(gi, qi, ki, vi, oi, li, 0.0, True, scale=scale)
        dq[r, a:z] = dqi[0].transpose(0, 1)
        dk[r, a:z] = dki[0].transpose(0, 1)
        dv[r, a:z] = dvi[0].transpose(0, 1)
    return dq, dk, dv


#: The variable-length kernels (aten's; tests hand in a CPU stand-in keeping their contract).
VARLEN_OPS = torch.ops.aten


def uses_varlen(q: torch.Tensor) -> bool:
    """Whether q's device runs the variable-length CUDA kernels (else the CPU kernel)."""
    return q.device.type == "cuda"


def _cuda_causal(q, k, v, scale: float, cu: torch.Tensor, left: Optional[int] = None):
    """Variable-length flash attention over the flattened positions; `max_q` is the row
    length (an upper bound of every segment: the kernel sizes its grid by it, no host
    read of the offsets is needed). Contract (aten/src/ATen/native/transformers/cuda/
    flash_attn, FlashAttention-2's mha_varlen_fwd): q [total, h, D], k and v [total, kv
    heads, D] (h a multiple of kv heads), int32 offsets; out [total, h, D], the softmax's
    logsumexp [h, total] in float32."""
    b, t, h, d = q.shape
    window = {} if left is None else {"window_size_left": left, "window_size_right": 0}
    out, lse, rng, unused, _ = VARLEN_OPS._flash_attention_forward(
        q.reshape(b * t, h, d), k.reshape(b * t, k.shape[2], d), v.reshape(b * t, v.shape[2], d),
        cu, cu, t, t, 0.0, True, False, scale=scale, **window)
    return out.view(b, t, h, d), lse.view(h, b, t).permute(1, 2, 0), (rng, unused)


def _cuda_causal_backward(g, q, k, v, out, lse, scale: float, cu: torch.Tensor, state,
                          left: Optional[int] = None):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    dq, dk, dv = VARLEN_OPS._flash_attention_backward(
        g.reshape(b * t, h, d).contiguous(), q.reshape(b * t, h, d), k.reshape(b * t, kvh, d),
        v.reshape(b * t, kvh, d), out.reshape(b * t, h, d),
        lse.permute(2, 0, 1).reshape(h, b * t).contiguous(), cu, cu, t, t, 0.0, True,
        state[0], state[1], scale=scale,
        **({} if left is None else {"window_size_left": left, "window_size_right": 0}))
    return dq.view(b, t, h, d), dk.view(b, t, kvh, d), dv.view(b, t, kvh, d)


# ------------------------------------------------------------------ same-position terms

def _grouped(x: torch.Tensor, kvh: int) -> torch.Tensor:
    """[B, T, h, ...] -> [B, T, kv heads, h / kv heads, ...] (query head i reads kv head
    i // (h / kv heads), as repeat_interleave pairs them)."""
    b, t, h = x.shape[:3]
    return x.view(b, t, kvh, h // kvh, *x.shape[3:])


def _diag_scores(q: torch.Tensor, kj: torch.Tensor, scale: float) -> torch.Tensor:
    """q . k_j * scale per position and query head, float32 [B, T, h]."""
    b, t, h, _ = q.shape
    s = torch.einsum("btgrd,btgd->btgr", _grouped(q, kj.shape[2]), kj)
    return s.float().reshape(b, t, h) * scale


class FusedTTTAttention(torch.autograd.Function):
    """out [B, T, h, D] of the training-time-test attention (module docstring)."""

    @staticmethod
    def forward(ctx, scale: float, cu: Optional[torch.Tensor], window: Optional[int],
                q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                *same: torch.Tensor) -> torch.Tensor:
        n = len(same) // 2
        ks, vs = same[:n], same[n:]
        state = bounds = None
        # a sliding window of W positions: the query's real position is n steps on, and
        # its n drafted keys take n places of the window: step-0 keys W - 1 - n back
        left = None if window is None else window - 1 - n
        ctx.causal = left is None or left >= 0  # else no step-0 key is within the window
        if not ctx.causal:
            out0 = torch.zeros_like(q)
            lse0 = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        elif uses_varlen(q):
            if cu is None:
                cu = rows_cu_seqlens(q.shape[0], q.shape[1], q.device)
            out0, lse0, state = _cuda_causal(q, k0, v0, scale, cu, left)
        else:
            if left is not None:
                raise RuntimeError("the CPU flash kernel has no sliding window: use "
                                   "train.attention=auto or reference with draft.sliding_window")
            bounds = None if cu is None else cu.tolist()  # a CPU tensor: no device sync
            out0, lse0 = _cpu_causal(q, k0, v0, scale, bounds)
        ctx.left = left
        if n:
            s = torch.stack([_diag_scores(q, kj, scale) for kj in ks], -1)  # [B,T,h,n]
            lse = torch.logaddexp(lse0, torch.logsumexp(s, -1))
            w = torch.exp(s - lse[..., None])
            acc = out0.float() * torch.exp(lse0 - lse)[..., None]
            kvh = k0.shape[2]
            grouped = _grouped(acc, kvh)
            wg = _grouped(w, kvh)
            for j in range(n):
                grouped += wg[..., j, None] * vs[j].float()[:, :, :, None, :]
            out = acc.to(q.dtype)
        else:
            out, lse = out0, lse0
        ctx.scale, ctx.n, ctx.cu, ctx.bounds, ctx.state = scale, n, cu, bounds, state
        ctx.save_for_backward(q, k0, v0, out, lse, *same)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        q, k0, v0, out, lse, *same = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs = same[:n], same[n:]
        if not ctx.causal:
            dq, dk0, dv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        elif uses_varlen(q):
            dq, dk0, dv0 = _cuda_causal_backward(g, q, k0, v0, out, lse, scale, ctx.cu,
                                                 ctx.state, ctx.left)
        else:
            dq, dk0, dv0 = _cpu_causal_backward(g, q, k0, v0, out, lse, scale, ctx.bounds)
        dks, dvs = [], []
        if n:
            kvh = k0.shape[2]
            gf, qf = g.float(), q.float()
            dd = (gf * out.float()).sum(-1)  # [B,T,h]: rowsum(dO * out)
            dqf = dq.float()
            dqg, qg, gg = _grouped(dqf, kvh), _grouped(qf, kvh), _grouped(gf, kvh)
            for j in range(n):
                w = torch.exp(_diag_scores(q, ks[j], scale) - lse)
                dw = torch.einsum("btgrd,btgd->btgr", gg, vs[j].float()).reshape(w.shape)
                ds = _grouped(w * (dw - dd), kvh)  # [B,T,g,r]
                dqg += scale * ds[..., None] * ks[j].float()[:, :, :, None, :]
                dks.append((scale * torch.einsum("btgr,btgrd->btgd", ds, qg)).to(ks[j].dtype))
                dvs.append(torch.einsum("btgr,btgrd->btgd", _grouped(w, kvh), gg)
                           .to(vs[j].dtype))
            dq = dqf.to(q.dtype)
        return (None, None, None, dq, dk0, dv0, *dks, *dvs)


def fused_ttt_attention(q: torch.Tensor, cache: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                        scale: float, cu_seqlens: Optional[torch.Tensor] = None,
                        window: Optional[int] = None) -> torch.Tensor:
    """The training-time-test attention of q [B,T,h,D] over `cache` (step 0's keys and
    values first, then later steps', each [B,T,kv heads,D]) -> [B,T,h,D]; `window`: a
    sliding window of that many positions (CUDA only, fused_reason)."""
    (k0, v0), later = cache[0], cache[1:]
    same = [kj for kj, _ in later] + [vj for _, vj in later]
    if cu_seqlens is not None and not uses_varlen(q):
        cu_seqlens = cu_seqlens.cpu()
    return FusedTTTAttention.apply(scale, cu_seqlens, window, q, k0, v0, *same)
