"""Training-time test: loss and per-step accuracy of an unrolled draft, and chain acceptance.

Index convention (position t of a sample of length n):
  step k at t reads token x[t+1+k] and predicts the verifier's distribution at position
  t+1+k (the verifier's next-token distribution after x[..t+1+k]). It counts when
  t+2+k < n and x[t+2+k] is a trained (assistant) token.
Targets come from the stored last hidden states through the verifier's own lm_head,
restricted to the draft vocabulary; accuracy compares the draft's top-1 (mapped to a
target id) with the verifier's greedy token over its full vocabulary. A batch stored with
a top-k teacher (``topk_ids``, ``topk_logp``: data/compact.py) trains on those k tokens'
probabilities inside the draft vocabulary, renormalised, and its greedy token is
topk_ids[..., 0].
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from eagle3x.draft.model import Eagle3Draft
from eagle3x.weights import verifier_logits


def shift(x: torch.Tensor, s: int, fill: float = 0) -> torch.Tensor:
    """x[:, s:] padded back to x's length along dim 1 (all `fill` when s >= the length)."""
    if s == 0:
        return x
    s = min(s, x.shape[1])  # a batch shorter than the unrolled steps
    pad = x.new_full((x.shape[0], s, *x.shape[2:]), fill)
    return torch.cat([x[:, s:], pad], dim=1)


@torch.no_grad()
def verifier_targets(last: torch.Tensor, head: torch.Tensor, draft_targets: torch.Tensor,
                     chunk: int = 2048, greedy_only: bool = False,
                     softcap: Optional[float] = None,
                     scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """Greedy token ids [B, T] and (unless `greedy_only`) log-probs over the draft vocab
    [B, T, Vd] of the verifier (its logits as `weights.verifier_logits` makes them:
    `scale`, then `softcap`)."""
    b, t, h = last.shape
    flat = last.reshape(-1, h)
    greedy, logp = [], []
    for i in range(0, flat.shape[0], chunk):
        logits = verifier_logits(flat[i:i + chunk], head, softcap, scale)
        greedy.append(logits.argmax(-1))
        if not greedy_only:
            logp.append(torch.log_softmax(logits[:, draft_targets], -1))
    out = {"greedy": torch.cat(greedy).view(b, t)}
    if not greedy_only:
        out["logp"] = torch.cat(logp).view(b, t, -1)
    return out


def valid_mask(loss_mask: torch.Tensor, lengths: torch.Tensor, k: int,
               doc_end: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Positions whose step-k prediction is trained. `doc_end` [B, T] (packed rows): where
    each position's document ends; a prediction never reaches into the next document."""
    b, t = loss_mask.shape
    pos = torch.arange(t, device=loss_mask.device).expand(b, t)
    end = lengths[:, None] if doc_end is None else doc_end
    return (pos + 2 + k < end) & shift(loss_mask, 2 + k).bool()


def ttt_step_metrics(draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                     steps: int, step_weight: float, chunk: int = 2048,
                     softcap: Optional[float] = None,
                     scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """Weighted soft cross-entropy over `steps` unrolled steps, plus loss_k / acc_k each
    (and ce_k, the summed cross-entropy, and count_k, its positions, for other reductions).

    Only trained positions reach the heads. Up to `chunk` positions per step the draft's
    and the verifier's logits over the draft vocabulary are computed at once; beyond it
    `chunk` rows at a time, each recomputed in backward rather than kept, so no
    [positions, vocab] buffer lives across steps (memory linear in T, small in vocab).
    `softcap` and `scale`: what the verifier applies after its lm_head (VerifierInfo).
    """
    ids = batch["input_ids"]
    b, t = ids.shape
    targets_of_draft = torch.arange(draft.shape.draft_vocab_size, device=head.device) + draft.d2t
    topk = "topk_ids" in batch
    if topk:  # the stored top-k teacher: nothing to compute from hidden states
        whole, teacher_head, index = False, None, draft_index(draft)
        tgt = {"greedy": batch["topk_ids"][..., 0].long()}
    else:
        last = batch["last_hidden"]
        # A batch of at most `chunk` positions: the verifier's log-probs over the draft vocab
        # once for all positions and steps. Longer: recomputed per chunk from the stored states.
        whole, index = b * t <= chunk, None
        tgt = verifier_targets(last, head, targets_of_draft, greedy_only=not whole,
                               softcap=softcap, scale=scale)
        teacher_head = None if whole else head[targets_of_draft]  # [Vd, Ht]
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(ids.shape[0], steps)], dim=1)
    hidden = draft.unroll_hidden(batch["aux_hidden"].to(draft.fc.weight.dtype), tokens, steps,
                                 batch.get("positions"), batch.get("docs"))
    out: Dict[str, torch.Tensor] = {}
    total = hidden[0].new_zeros((), dtype=torch.float32)
    for k, hk in enumerate(hidden):
        rows, cols = valid_mask(batch["loss_mask"], batch["lengths"], k,
                                batch.get("doc_end")).nonzero(as_tuple=True)
        h = hk[rows, cols]
        if topk:
            teacher = batch["topk_ids"][rows, cols + 1 + k]
            teacher_logp = batch["topk_logp"][rows, cols + 1 + k]
        else:
            teacher = (tgt["logp"] if whole else last)[rows, cols + 1 + k]
            teacher_logp = None
        ce, hits = hk.new_zeros((), dtype=torch.float32), 0
        for a in range(0, max(len(rows), 1), chunk):
            args = (draft, teacher_head, h[a:a + chunk], teacher[a:a + chunk],
                    None if teacher_logp is None else teacher_logp[a:a + chunk], index,
                    softcap, scale)
            if len(rows) > chunk and torch.is_grad_enabled():
                ce_c, pred = checkpoint(_soft_ce, *args, use_reentrant=False)
            else:
                ce_c, pred = _soft_ce(*args)
            ce = ce + ce_c
            greedy = tgt["greedy"][rows[a:a + chunk], cols[a:a + chunk] + 1 + k]
            hits = hits + (pred == greedy).sum()
        n = torch.tensor(len(rows), device=hk.device)
        loss_k = ce / n.clamp(min=1)
        total = total + (step_weight ** k) * loss_k
        out[f"loss_{k}"], out[f"ce_{k}"], out[f"count_{k}"] = loss_k.detach(), ce, n
        out[f"acc_{k}"] = torch.as_tensor(hits, device=hk.device).float() / n.clamp(min=1)
    out["loss"] = total
    out["accept_len"] = expected_accept_length([out[f"acc_{k}"] for k in range(steps)])
    return out


def draft_index(draft: Eagle3Draft) -> torch.Tensor:
    """[target vocab] -> the draft id of each verifier token, -1 outside the draft vocab."""
    vd = draft.shape.draft_vocab_size
    index = torch.full((draft.t2d.numel(),), -1, dtype=torch.long, device=draft.d2t.device)
    index[torch.arange(vd, device=draft.d2t.device) + draft.d2t] = torch.arange(
        vd, device=draft.d2t.device)
    return index


def topk_distribution(ids: torch.Tensor, logp: torch.Tensor, index: torch.Tensor,
                      draft_vocab: int) -> torch.Tensor:
    """[n, draft_vocab] probabilities from the verifier's top-k (`ids`, `logp` [n, k] over
    its full vocabulary): the entries inside the draft vocabulary, renormalised (a row
    with none is all zeros and adds no loss)."""
    d = index[ids.long()]
    keep = d >= 0
    w = logp.float().exp() * keep
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.zeros(ids.shape[0], draft_vocab, device=ids.device).scatter_add_(
        1, d.clamp(min=0), w)


def _soft_ce(draft: Eagle3Draft, teacher_head: Optional[torch.Tensor], hidden: torch.Tensor,
             teacher: torch.Tensor, teacher_logp: Optional[torch.Tensor] = None,
             index: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
             scale: float = 1.0):
    """(sum over rows of the soft cross-entropy of the draft's logits against the verifier's
    distribution over the draft vocabulary, the draft's top-1 as target ids). `teacher`:
    the verifier's log-probs over the draft vocab, or (with `teacher_head`) its last
    hidden states, or (with `teacher_logp` and `index`) its top-k token ids."""
    logits = draft.head(hidden)
    with torch.no_grad():
        if teacher_logp is not None:
            p = topk_distribution(teacher, teacher_logp, index, logits.shape[-1])
        elif teacher_head is None:
            p = teacher.exp()
        else:
            p = torch.log_softmax(verifier_logits(teacher, teacher_head, softcap, scale),
                                  -1).exp()
        pred = draft.draft_to_target(logits.argmax(-1))
    return -(p * torch.log_softmax(logits.float(), -1)).sum(), pred


def expected_accept_length(accs: List[torch.Tensor]) -> torch.Tensor:
    """1 + sum_k prod_{j<=k} acc_j: tokens per verifier pass implied by per-step accuracy."""
    device = accs[0].device if accs else None
    total, running = torch.ones((), device=device), torch.ones((), device=device)
    for a in accs:
        running = running * a.detach().float()
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
    if greedy is None and "topk_ids" in batch:
        greedy = batch["topk_ids"][..., 0].long()
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
