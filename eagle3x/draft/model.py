"""The EAGLE-3 draft as a plain nn.Module, with the parameter names vLLM and SGLang load.

    fc        [H, 3*Ht]   concatenated aux hidden states of the verifier -> H
              (optionally after `input_norm`, one RMSNorm over the 3*Ht concatenation,
              and/or `fc_norm`, one RMSNorm per aux state: DraftShape.norm_before_fc,
              .fc_norm)
    midlayer  the first Llama decoder layer, whose attention reads [norm(embed), norm(hidden)]
              (2H); `more_layers` the next ones (DraftShape.num_layers), plain Llama decoder
              layers over the residual stream (exported as layers.1, layers.2, ...)
    norm      final RMSNorm;  lm_head [draft_vocab, H];  d2t / t2d vocabulary maps

One draft step at position t reads the verifier feature (step 0) or its own previous
output (step k>0) together with the embedding of the next token, and returns logits over
the draft vocabulary plus the hidden state for the next step: the pre-norm output, or the
normed one with DraftShape.norm_output. Every variant computes what vLLM's
Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py) computes from the same
config.json keys: `LlamaDecoderLayer.forward` (the first layer's `_norm_before_residual` /
`_norm_after_residual`, later layers' fused add + norm), `LlamaModel.forward` (the final
norm and `norm_output`), `combine_hidden_states` (input_norm, then fc_norm, then fc).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint
import torch.nn as nn
import torch.nn.functional as F

from eagle3x.draft.attention import (cu_seqlens_from_docs, device_check, fused_reason,
                                     fused_ttt_attention)
from eagle3x.weights import rms_norm


@dataclass
class DraftShape:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_aux: int = 3
    #: decoder layers (vLLM serves several; SGLang's EAGLE-3 Llama draft one)
    num_layers: int = 1
    #: an RMSNorm over the concatenated aux states before fc (vLLM: norm_before_fc)
    norm_before_fc: bool = False
    #: one RMSNorm per aux state before fc (vLLM: fc_norm)
    fc_norm: bool = False
    #: the first layer's residual stream starts from the normed hidden state
    norm_before_residual: bool = False
    #: the next step reads the final norm's output instead of the pre-norm hidden state
    norm_output: bool = False
    #: every layer's attention sees the last `sliding_window` positions only (vLLM:
    #: sliding_window with layer_types "sliding_attention"); None: all before
    sliding_window: Optional[int] = None

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
         token_major: bool = False) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout). x: [B, heads, T, D] (or [B, T, heads,
    D] with `token_major`); positions: [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    pos = positions.float()[:, :, None, None] if token_major else positions.float()[:, None, :, None]
    ang = pos * inv  # [B, 1, T, D/2] (token-major: [B, T, 1, D/2])
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    block = 512  # positions per attention block past which memory stays linear in T
    #: "auto": the fused kernel (draft/attention.py) where the device and dtype have one,
    #: else the reference below; "fused" / "reference" force one (`train.attention`)
    impl = "auto"

    def __init__(self, s: DraftShape, in_size: Optional[int] = None):
        super().__init__()
        self.s = s
        self.window = s.sliding_window
        d = in_size or 2 * s.hidden_size  # the first layer reads [embedding, hidden]
        self.q_proj = nn.Linear(d, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(d, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(d, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        s = self.s
        q = self.q_proj(x).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = rope(q, positions, s.rope_theta), rope(k, positions, s.rope_theta)
        return q, k, v  # k, v: num_kv_heads (ttt_attention repeats them for each query head)

    def qkv_tokens(self, x: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """q [B, T, heads, D], k and v [B, T, kv heads, D] (the fused kernel's layout)."""
        b, t, _ = x.shape
        s = self.s
        q = rope(self.q_proj(x).view(b, t, s.num_heads, s.head_dim), positions, s.rope_theta,
                 token_major=True)
        k = rope(self.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim), positions,
                 s.rope_theta, token_major=True)
        v = self.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim)
        return q, k, v

    def uses_fused(self, x: torch.Tensor) -> bool:
        """Whether this call takes the fused kernel: `impl`, and for "auto" whether the
        device has one for the dtype q will have (autocast's, else the weights')."""
        if self.impl == "reference":
            return False
        if self.impl == "fused":
            return True
        kind = x.device.type
        dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                 else self.q_proj.weight.dtype)
        if fused_reason(x.device, dtype, self.s.head_dim, self.window) is not None:
            return False
        if kind == "cuda":  # held to the dense softmax on this GPU once, else the reference
            why = device_check(x.device, dtype, self.s.num_heads, self.s.num_kv_heads,
                               self.s.head_dim, self.window)
            if why is not None:
                if not getattr(Attention, "_warned", False):
                    import logging

                    logging.getLogger("eagle3x").warning(
                        "training-time-test attention: %s; using the reference path", why)
                    Attention._warned = True
                return False
        return True

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: List[Tuple[torch.Tensor, torch.Tensor]],
                docs: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training-time-test attention. cache[0] holds the step-0 keys/values of every
        position (causal); cache[1:] hold earlier draft steps, seen only at the same
        position (the chain a drafted token extends). The new step is appended. `docs`
        [B, T] (packed rows): a position sees only positions of its own document;
        `cu_seqlens` (the fused kernel's segments of the flattened positions: documents
        and padding tails, attention.cu_seqlens_from_docs) saves deriving them from
        `docs`. The cache's layout follows the path: every step of one unroll takes the
        same one."""
        b, t = x.shape[:2]
        scale = 1.0 / math.sqrt(self.s.head_dim)
        if self.uses_fused(x):
            q, k, v = self.qkv_tokens(x, positions)
            cache.append((k, v))
            if cu_seqlens is None and docs is not None:
                cu_seqlens = cu_seqlens_from_docs(docs)
            out = fused_ttt_attention(q, cache, scale, cu_seqlens, self.window)
            return self.o_proj(out.reshape(b, t, -1))
        q, k, v = self.qkv(x, positions)
        cache.append((k, v))
        out = ttt_attention(q, cache, scale, self.block, docs, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _attend(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, start: int, scale: float,
            docs_q: Optional[torch.Tensor], docs_k: Optional[torch.Tensor],
            window: Optional[int], *same: torch.Tensor) -> torch.Tensor:
    """Queries at positions start.. over step-0 keys 0..(their position) and the
    same-position keys/values of later steps (`same` = k1..kn, v1..vn, sliced like q);
    with document ids (docs_q [B, Tq], docs_k [B, Tk]) only keys of the query's document;
    with a `window`, only step-0 keys within it of the query's real position (n steps on:
    the last window - n of them, since the n drafted keys are inside it too)."""
    rep = q.shape[1] // k0.shape[1]
    if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
        k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
        same = tuple(x.repeat_interleave(rep, 1) for x in same)
    tq, tk = q.shape[2], k0.shape[2]
    key = torch.arange(tk, device=q.device)[None, :]
    query = torch.arange(start, start + tq, device=q.device)[:, None]
    causal = key <= query
    if window is not None:
        causal = causal & (key > query + len(same) // 2 - window)
    if docs_q is not None:
        causal = causal & (docs_q[:, None, :, None] == docs_k[:, None, None, :])
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    n = len(same) // 2
    if n:
        scores.append(torch.stack([(q * kj).sum(-1) * scale for kj in same[:n]], dim=-1))
    probs = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
    out = probs[..., :tk] @ v0
    if n:
        vs = torch.stack(same[n:], dim=-2)  # [B, h, Tq, steps, D]
        out = out + (probs[..., tk:].unsqueeze(-1) * vs).sum(-2)
    return out


def ttt_attention(q: torch.Tensor, cache: List[Tuple[torch.Tensor, torch.Tensor]], scale: float,
                  block: int = 512, docs: Optional[torch.Tensor] = None,
                  window: Optional[int] = None) -> torch.Tensor:
    """softmax(q . [causal step-0 keys | same-position keys of steps 1..]) @ values.

    q is [B, heads, T, D], every cache entry [B, kv heads, T, D]. Up to `block` positions
    this is one dense [T, T + steps] score matrix. Longer sequences go `block` queries at a
    time (each block reads only the keys up to its last position), and under autograd each
    block is recomputed in backward instead of kept (torch.utils.checkpoint): what stays
    alive for backward is q, k, v (k, v at kv-head size) and the output, so memory grows
    linearly in T. The arithmetic per query is the dense path's, so the two agree to
    rounding. `docs` [B, T]: document ids of packed rows (attention stays within one);
    `window`: sliding-window attention (_attend).
    """
    (k0, v0), later = cache[0], cache[1:]
    t = q.shape[2]
    same = [kj for kj, _ in later] + [vj for _, vj in later]
    if t <= block:
        return _attend(q, k0, v0, 0, scale, docs, docs, window, *same)
    outs = []
    for a in range(0, t, block):
        e = min(a + block, t)
        args = (q[:, :, a:e], k0[:, :, :e], v0[:, :, :e], a, scale,
                None if docs is None else docs[:, a:e], None if docs is None else docs[:, :e],
                window, *[x[:, :, a:e] for x in same])
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k0, v0, *same)):
            outs.append(checkpoint(_attend, *args, use_reentrant=False))
        else:
            outs.append(_attend(*args))
    return torch.cat(outs, dim=2)


class MLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    #: recompute the MLP in backward (rather than keep its 4 x intermediate activations
    #: per position) when a batch holds more positions than this (`train.checkpoint_mlp_tokens`)
    checkpoint_mlp_tokens = 16384

    def _mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] * h.shape[1] > self.checkpoint_mlp_tokens and torch.is_grad_enabled():
            # long batches: the MLP (4 x intermediate per position) is recomputed in
            # backward rather than kept, the largest per-position term of a step
            return checkpoint(self._mlp, h, use_reentrant=False)
        return self._mlp(h)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h))


class MidLayer(_Layer):
    """The first decoder layer: attention over [norm(embedding), norm(hidden)]."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)
        self.norm_before_residual = s.norm_before_residual

    def split(self, embeds, hidden, positions, cache, docs=None, cu_seqlens=None):
        """(MLP output, residual): their sum is the layer's output."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual, normed = hidden, hidden
        else:
            residual, normed = hidden, self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.self_attn(x, positions, cache, docs, cu_seqlens) + residual
        return self._mlp_out(h), h


class DecoderLayer(_Layer):
    """A later decoder layer: a plain Llama layer over the residual stream (H in)."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, in_size=s.hidden_size)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def split(self, out, residual, positions, cache, docs=None, cu_seqlens=None):
        residual = out + residual
        h = self.self_attn(self.input_layernorm(residual), positions, cache, docs,
                           cu_seqlens) + residual
        return self._mlp_out(h), h


class Eagle3Draft(nn.Module):
    def __init__(self, s: DraftShape, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        self.shape = s
        self.embed_tokens = nn.Embedding(s.target_vocab_size, s.hidden_size)
        if s.norm_before_fc:
            self.input_norm = RMSNorm(s.num_aux * s.target_hidden_size, s.rms_norm_eps)
        if s.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(s.target_hidden_size, s.rms_norm_eps)
                                         for _ in range(s.num_aux))
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s)
        if s.num_layers > 1:
            self.more_layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers - 1))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.long().clone())
        self.register_buffer("t2d", t2d.bool().clone())

    def layers(self) -> List[_Layer]:
        return [self.midlayer, *getattr(self, "more_layers", [])]

    def set_layer_options(self, **options) -> None:
        """Set attention / MLP options (impl, block, checkpoint_mlp_tokens) on every layer."""
        for layer in self.layers():
            for name, value in options.items():
                target = layer if name == "checkpoint_mlp_tokens" else layer.self_attn
                setattr(target, name, value)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """What fc reads of the verifier's concatenated aux states (vLLM's
        combine_hidden_states: input_norm, then the per-state fc_norm)."""
        if self.shape.norm_before_fc:
            aux = self.input_norm(aux)
        if self.shape.fc_norm:
            aux = torch.cat([norm(chunk) for norm, chunk in
                             zip(self.fc_norm, aux.chunk(self.shape.num_aux, dim=-1))], dim=-1)
        return aux

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The first step's hidden state from the verifier's concatenated aux states."""
        return self.fc(self.fc_input(aux))

    def layers_forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       cache: List, docs: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder layers on one step: the pre-norm output. `cache` holds one list of
        keys/values per layer (filled on the first call)."""
        layers = self.layers()
        if not cache:
            cache.extend([] for _ in layers)
        out, residual = layers[0].split(embeds, hidden, positions, cache[0], docs, cu_seqlens)
        for layer, c in zip(layers[1:], cache[1:]):
            out, residual = layer.split(out, residual, positions, c, docs, cu_seqlens)
        return out + residual

    def next_hidden(self, prenorm: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's output (vLLM's aux_output)."""
        return self.norm(prenorm) if self.shape.norm_output else prenorm

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: List) -> Tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (logits over the draft vocab, the hidden state the next step reads)."""
        h = self.layers_forward(self.embed_tokens(token_ids), hidden, positions, cache)
        return self.head(h), self.next_hidden(h)

    def unroll_hidden(self, aux: torch.Tensor, token_ids: torch.Tensor, steps: int,
                      positions: Optional[torch.Tensor] = None,
                      docs: Optional[torch.Tensor] = None,
                      cu_seqlens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Training-time test over a whole sequence, stopping before the head.

        aux [B, T, 3Ht]: verifier features at each position; token_ids [B, T + steps]:
        the tokens each step reads (step k at position t reads token_ids[:, t + k]).
        Returns each step's pre-norm hidden state [B, T, H]; `head(h)` gives its logits.
        Packed rows (several samples each) pass each position's document id in `docs` and
        its position within the document in `positions` (and may pass the documents as
        segment offsets, `cu_seqlens`, for the fused attention kernel).
        """
        b, t, _ = aux.shape
        if positions is None:
            positions = torch.arange(t, device=aux.device).expand(b, t)
        hidden = self.combine(aux)
        if docs is not None and cu_seqlens is None and self.midlayer.self_attn.uses_fused(hidden):
            cu_seqlens = cu_seqlens_from_docs(docs)  # once, not at every step
        cache: List = []
        out = []
        for k in range(steps):
            h = self.layers_forward(self.embed_tokens(token_ids[:, k:k + t]), hidden,
                                    positions + k, cache, docs, cu_seqlens)
            out.append(h)
            hidden = self.next_hidden(h)
        return out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of pre-norm hidden states."""
        return self.lm_head(self.norm(hidden))

    def unroll(self, aux: torch.Tensor, token_ids: torch.Tensor, steps: int,
               positions: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """`unroll_hidden`'s steps as logits over the draft vocab, [B, T, draft_vocab] each."""
        return [self.head(h) for h in self.unroll_hidden(aux, token_ids, steps, positions)]
