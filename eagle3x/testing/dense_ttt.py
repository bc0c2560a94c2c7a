"""The training-time test as eagle3x computed it before the linear-memory rewrite: one dense
[B, heads, T, T + steps] score matrix per step kept for backward, and every step's logits and
the verifier's log-probs over the draft vocab held at once. Kept as the reference the
memory-saving paths in eagle3x/draft/model.py and ttt.py must reproduce (the tests, bench/ttt_memory.py).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from eagle3x.draft.model import Eagle3Draft
from eagle3x.draft.ttt import expected_accept_length, shift, valid_mask, verifier_targets


def dense_attention(attn, x: torch.Tensor, positions: torch.Tensor, cache: List) -> torch.Tensor:
    q, k, v = attn.qkv(x, positions)
    rep = attn.s.num_heads // attn.s.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    cache.append((k, v))
    k0, v0 = cache[0]
    t = x.shape[1]
    scale = 1.0 / math.sqrt(attn.s.head_dim)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    if len(cache) > 1:
        diag = torch.stack([(q * kj).sum(-1) * scale for kj, _ in cache[1:]], dim=-1)
        scores.append(diag)
    probs = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
    out = probs[..., :t] @ v0
    if len(cache) > 1:
        vs = torch.stack([vj for _, vj in cache[1:]], dim=-2)
        out = out + (probs[..., t:].unsqueeze(-1) * vs).sum(-2)
    return attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], t, -1))


def dense_unroll(draft: Eagle3Draft, aux: torch.Tensor, token_ids: torch.Tensor,
                 steps: int) -> List[torch.Tensor]:
    b, t, _ = aux.shape
    positions = torch.arange(t, device=aux.device).expand(b, t)
    layer, hidden, cache, out = draft.midlayer, draft.fc(aux), [], []
    for k in range(steps):
        embeds = draft.embed_tokens(token_ids[:, k:k + t])
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        h = dense_attention(layer.self_attn, x, positions + k, cache) + hidden
        hidden = layer.mlp(layer.post_attention_layernorm(h)) + h
        out.append(draft.lm_head(draft.norm(hidden)))
    return out


def dense_step_metrics(draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                       steps: int, step_weight: float) -> Dict[str, torch.Tensor]:
    targets_of_draft = torch.arange(draft.shape.draft_vocab_size, device=head.device) + draft.d2t
    tgt = verifier_targets(batch["last_hidden"], head, targets_of_draft)
    ids = batch["input_ids"]
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(ids.shape[0], steps)], dim=1)
    logits = dense_unroll(draft, batch["aux_hidden"].to(draft.fc.weight.dtype), tokens, steps)
    out: Dict[str, torch.Tensor] = {}
    total = logits[0].new_zeros((), dtype=torch.float32)
    for k, lk in enumerate(logits):
        valid = valid_mask(batch["loss_mask"], batch["lengths"], k)
        p_logp = shift(tgt["logp"], 1 + k)
        ce = -(p_logp.exp() * torch.log_softmax(lk.float(), -1)).sum(-1)
        n = valid.sum().clamp(min=1)
        loss_k = (ce * valid).sum() / n
        pred = draft.draft_to_target(lk.argmax(-1))
        acc_k = ((pred == shift(tgt["greedy"], 1 + k, -1)) & valid).sum().float() / n
        total = total + (step_weight ** k) * loss_k
        out[f"loss_{k}"], out[f"acc_{k}"] = loss_k.detach(), acc_k.detach()
        out[f"count_{k}"] = valid.sum().detach()
    out["loss"] = total
    out["accept_len"] = expected_accept_length([out[f"acc_{k}"] for k in range(steps)])
    return out
