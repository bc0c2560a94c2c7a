"""Training-time test: loss and per-step accuracy of an unrolled draft, and chain acceptance.

Index convention (position t of a sample of length n):
  step k at t reads token x[t+1+k] and predicts the verifier's distribution at position
  t+1+k (the verifier's next-token distribution after x[..t+1+k]). It counts when
  t+2+k < n and x[t+2+k] is a trained (assistant) token.
Targets come from the stored last hidden states through the verifier's own lm_head,
restricted to the draft vocabulary; accuracy compares the draft's top-1 (mapped to a
target id) with the verifier's greedy token over its full vocabulary.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from eagle3x.draft.model import Eagle3Draft


def shift(x: torch.Tensor, s: int, fill: float = 0) -> torch.Tensor:
    """x[:, s:] padded back to x's length along dim 1 (all `fill` when s >= the length)."""
    if s == 0:
        return x
    s = min(s, x.shape[1])  # a batch shorter than the unrolled steps
    pad = x.new_full((x.shape[0], s, *x.shape[2:]), fill)
    return torch.cat([x[:, s:], pad], dim=1)


@torch.no_grad()
def verifier_targets(last: torch.Tensor, head: torch.Tensor, draft_targets: torch.Tensor,
                     chunk: int = 2048) -> Dict[str, torch.Tensor]:
    """Greedy token ids [B, T] and log-probs over the draft vocab [B, T, Vd] of the verifier."""
    b, t, h = last.shape
    flat = last.reshape(-1, h)
    greedy, logp = [], []
    for i in range(0, flat.shape[0], chunk):
        logits = flat[i:i + chunk].to(head.dtype) @ head.T
        greedy.append(logits.argmax(-1))
        logp.append(torch.log_softmax(logits[:, draft_targets].float(), -1))
    return {"greedy": torch.cat(greedy).view(b, t), "logp": torch.cat(logp).view(b, t, -1)}


def valid_mask(loss_mask: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Positions whose step-k prediction is trained."""
    b, t = loss_mask.shape
    pos = torch.arange(t, device=loss_mask.device).expand(b, t)
    return (pos + 2 + k < lengths[:, None]) & shift(loss_mask, 2 + k).bool()


def ttt_step_metrics(draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                     steps: int, step_weight: float) -> Dict[str, torch.Tensor]:
    """Weighted soft cross-entropy over `steps` unrolled steps, plus loss_k / acc_k each."""
    targets_of_draft = torch.arange(draft.shape.draft_vocab_size, device=head.device) + draft.d2t
    tgt = verifier_targets(batch["last_hidden"], head, targets_of_draft)
    ids = batch["input_ids"]
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(ids.shape[0], steps)], dim=1)
    logits = draft.unroll(batch["aux_hidden"].to(draft.fc.weight.dtype), tokens, steps)
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


def expected_accept_length(accs: List[torch.Tensor]) -> torch.Tensor:
    """1 + sum_k prod_{j<=k} acc_j: tokens per verifier pass implied by per-step accuracy."""
    total, running = torch.ones(()), torch.ones(())
    for a in accs:
        running = running * a.detach().float().cpu()
        total = total + running
    return total


@torch.no_grad()
def chain_acceptance(draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                     depth: int, greedy: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Offline greedy acceptance: from every position the draft proposes `depth` tokens in a
    chain (feeding its own proposals); proposals are accepted while each equals the
    verifier's greedy token. Returns per-position accepted counts and the valid mask.

    `greedy` [B, T], the verifier's greedy token after each position, defaults to the argmax
    of its head over the stored last hidden states; along a sequence that *is* the
    verifier's greedy continuation, pass the sequence's own next tokens."""
    if greedy is None:
        targets_of_draft = (torch.arange(draft.shape.draft_vocab_size, device=head.device)
                            + draft.d2t)
        greedy = verifier_targets(batch["last_hidden"], head, targets_of_draft)["greedy"]
    ids, aux = batch["input_ids"], batch["aux_hidden"].to(draft.fc.weight.dtype)
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    hidden, cache = draft.fc(aux), []
    token = shift(ids, 1)
    alive = valid_mask(batch["loss_mask"], batch["lengths"], 0)
    start = alive.clone()
    accepted = torch.zeros(b, t, dtype=torch.long, device=ids.device)
    for k in range(depth):
        logits, hidden = draft.step(token, hidden, positions + k, cache)
        token = draft.draft_to_target(logits.argmax(-1))
        in_range = positions + 2 + k < batch["lengths"][:, None]
        alive = alive & in_range & (token == shift(greedy, 1 + k, -1))
        accepted += alive.long()
    return {"accepted": accepted, "valid": start}
