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

from eagle3x.draft.model import Eagle3Draft
from eagle3x.weights import verifier_logits


def shift(x: torch.Tensor, s: int, fill: float = 0) -> torch.Tensor:
    """x[:, s:] padded back to x's length along dim 1 (all `fill` when s >= the length)."""
    if s == 0:
        return x
    s = min(s, x.shape[1])  # a batch shorter than the unrolled steps
    pad = x.new_full((x.shape[0], s, *x.shape[2:]), fill)
    return torch.cat([x[:, s:], pad], dim=1)


def feature_noise(aux: torch.Tensor, layers: int, amount: float,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """`aux` ([..., layers * H], the verifier's aux hidden states side by side) plus
    uniform noise in [-amount, amount] times each layer's RMS at that position (EAGLE-1's
    feature noise, made relative: one `amount` suits every verifier's scale). A new
    tensor in `aux`'s dtype; `aux` itself is left as it is. amount 0 returns `aux`."""
    if amount <= 0:
        return aux
    x = aux.float().unflatten(-1, (layers, -1))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (x + (2 * u - 1) * amount * rms).flatten(-2).to(aux.dtype)


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


def trained_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, steps: int,
                      doc_end: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Per step k < `steps`, the flat indices (row * T + t) of the positions whose step-k
    prediction is trained (`valid_mask`). The collate functions compute them on the host
    with the batch, so the training step never waits on the device to learn them."""
    return [valid_mask(loss_mask, lengths, k, doc_end).flatten().nonzero().squeeze(1)
            for k in range(steps)]


#: Up to this many bytes the verifier's distribution over the draft vocabulary is computed
#: once per batch for every position and shared by the steps; past it, per chunk of rows
#: (steps x the teacher's matmul, no [positions, vocab] table).
TEACHER_TABLE_BYTES = 2 << 30


class Teacher:
    """The verifier's distribution over the draft vocabulary at given flat positions, and
    its greedy token over its full vocabulary (accuracy). From the stored last hidden
    states through the verifier's head (a table computed once per batch, or per chunk of
    rows past TEACHER_TABLE_BYTES), or from a stored top-k teacher (data/compact.py)."""

    def __init__(self, draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                 softcap: Optional[float], scale: float, greedy: bool, chunk: int,
                 hard: bool = False, topk: Optional[int] = None):
        vd = draft.shape.draft_vocab_size
        self.vd, self.softcap, self.scale = vd, softcap, scale
        #: train.loss=hard: the most likely draft token; train.teacher_topk: the k most likely
        self.hard, self.keep = hard, topk
        self.table = self.last = self.topk = None
        self.greedy: Optional[torch.Tensor] = None
        if "topk_ids" in batch:
            ids, logp = batch["topk_ids"], batch["topk_logp"]
            self.topk = (ids.reshape(-1, ids.shape[-1]), logp.reshape(-1, logp.shape[-1]),
                         draft_index(draft))
            if greedy:
                self.greedy = self.topk[0][:, 0].long()
            return
        last = batch["last_hidden"]
        flat = last.reshape(-1, last.shape[-1])
        targets = torch.arange(vd, device=head.device) + draft.d2t
        self.head = head[targets]  # [Vd, Ht]
        kind = flat.device.type
        table_dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                       else torch.float32)
        with torch.no_grad():
            if greedy:  # over the full vocabulary, rows bounded so logits stay <= 512 MB
                rows = max(1, min(chunk, (1 << 27) // head.shape[0]))
                self.greedy = torch.cat([
                    verifier_logits(flat[a:a + rows], head, softcap, scale).argmax(-1)
                    for a in range(0, flat.shape[0], rows)])
            size = flat.shape[0] * vd * torch.finfo(table_dtype).bits // 8
            if size <= TEACHER_TABLE_BYTES:
                self.table = torch.empty(flat.shape[0], vd, dtype=table_dtype,
                                         device=flat.device)
                for a in range(0, flat.shape[0], chunk):
                    self.table[a:a + chunk] = torch.softmax(verifier_logits(
                        flat[a:a + chunk], self.head, softcap, scale), -1)
            else:
                self.last = flat

    def probs(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), draft vocab]: the teacher at flat positions `rows` (its most
        likely token one-hot with `hard`; its `keep` most likely renormalised)."""
        if self.table is not None:
            p = self.table[rows].float()
        elif self.topk is not None:
            ids, logp, index = self.topk
            p = topk_distribution(ids[rows], logp[rows], index, self.vd)
        else:
            p = torch.softmax(verifier_logits(self.last[rows], self.head, self.softcap,
                                              self.scale), -1)
        if self.hard:  # a row with no mass (a top-k teacher outside the vocab) stays empty
            top = p.argmax(-1, keepdim=True)
            return torch.zeros_like(p).scatter_(1, top, p.gather(1, top).gt(0).float())
        if self.keep is not None and self.keep < p.shape[-1]:
            v, i = p.topk(self.keep, dim=-1)
            p = torch.zeros_like(p).scatter_(1, i, v)
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        return p


class FusedSoftCE(torch.autograd.Function):
    """sum_k weights[k] * CE_k, where CE_k = sum over step k's rows of the soft
    cross-entropy of the draft's logits (x_k @ W^T, W the lm_head) against the teacher.
    The gradients are computed in the forward pass chunk by chunk (dCE/dlogits =
    softmax(logits) * sum(p) - p), so no [rows, vocab] buffer outlives its chunk and
    nothing is recomputed in backward; backward scales them. Also returns each step's
    CE_k and, with a greedy teacher, how many rows' top-1 (as a target id) is the
    verifier's greedy token (both detached)."""

    @staticmethod
    def forward(ctx, teacher: Teacher, rows: List[torch.Tensor], d2t: torch.Tensor,
                weights: torch.Tensor, chunk: int, want_grad: bool, w: torch.Tensor,
                *xs: torch.Tensor):
        kind = w.device.type
        cdt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
        grad_w = want_grad and ctx.needs_input_grad[6]
        with torch.autocast(kind, enabled=False):
            wc = w.to(cdt)
            gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if grad_w else None
            ces, hits, gxs = [], [], []
            for k, x in enumerate(xs):
                grad_x = want_grad and ctx.needs_input_grad[7 + k]
                gx = torch.empty_like(x) if grad_x else None
                ce = torch.zeros((), dtype=torch.float32, device=w.device)
                hit = torch.zeros((), dtype=torch.long, device=w.device)
                for a in range(0, x.shape[0], chunk):
                    xc = x[a:a + chunk].to(cdt)
                    tgt = rows[k][a:a + chunk]
                    z = xc @ wc.T
                    logq = torch.log_softmax(z.float(), -1)
                    p = teacher.probs(tgt)
                    ce = ce - (p * logq).sum()
                    if teacher.greedy is not None:
                        top = z.argmax(-1)
                        hit = hit + (top + d2t[top] == teacher.greedy[tgt]).sum()
                    if grad_x or grad_w:
                        dz = ((logq.exp() * p.sum(-1, keepdim=True) - p) * weights[k]).to(cdt)
                        if grad_x:
                            gx[a:a + chunk] = (dz @ wc).to(x.dtype)
                        if grad_w:
                            gw += (dz.T @ xc).float()
                ces.append(ce)
                hits.append(hit)
                gxs.append(gx)
            ce_all = torch.stack(ces) if ces else torch.zeros(0, device=w.device)
            loss = (ce_all * weights).sum()
        ctx.w_dtype = w.dtype
        ctx.save_for_backward(gw, *gxs)  # saved, so autograd's saved-tensor hooks see them
        ctx.mark_non_differentiable(ce_all)
        hits_all = torch.stack(hits) if hits else torch.zeros(0, device=w.device)
        ctx.mark_non_differentiable(hits_all)
        return loss, ce_all, hits_all

    @staticmethod
    def backward(ctx, g, _ce, _hits):
        gw, *gxs = ctx.saved_tensors
        gw = None if gw is None else (gw * g).to(ctx.w_dtype)
        gxs = [None if gx is None else gx * g.to(gx.dtype) for gx in gxs]
        return (None, None, None, None, None, None, gw, *gxs)


def ttt_step_metrics(draft: Eagle3Draft, batch: Dict[str, torch.Tensor], head: torch.Tensor,
                     steps: int, step_weight: float, chunk: int = 2048,
                     softcap: Optional[float] = None, scale: float = 1.0,
                     denominators: Optional[torch.Tensor] = None,
                     accuracy: bool = True, hard: bool = False,
                     teacher_topk: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Weighted soft cross-entropy over `steps` unrolled steps, plus loss_k / acc_k each
    (and ce_k, the summed cross-entropy, and count_k, its positions, for other reductions).

    `loss` = sum_k step_weight**k * ce_k / denominators[k]; the denominators default to
    this batch's counts (several processes pass the global counts / world: the global
    token mean). Only trained positions reach the heads: the batch's `select` (flat
    indices per step, `trained_positions`; computed here when absent) picks them, so no
    host synchronisation happens inside the step when the collate function made them.
    The teacher's distribution over the draft vocabulary is computed once per batch
    (`Teacher`); the loss runs `chunk` rows at a time with its gradients formed on the
    way (`FusedSoftCE`): memory linear in T, small in vocab, nothing recomputed.
    `accuracy=False` skips acc_k and the verifier's greedy token over its full
    vocabulary (a [positions, verifier vocab] matmul the loss does not need).
    `softcap` and `scale`: what the verifier applies after its lm_head (VerifierInfo).
    `hard` (train.loss=hard) trains towards the teacher's most likely draft token,
    `teacher_topk` towards its k most likely, renormalised (Teacher.probs).
    """
    ids = batch["input_ids"]
    b, t = ids.shape
    select = batch.get("select")
    if select is None:
        select = trained_positions(batch["loss_mask"], batch["lengths"], steps,
                                   batch.get("doc_end"))
    counts = batch.get("counts")
    if counts is None:
        counts = torch.tensor([len(r) for r in select], device=ids.device)
    counts = counts[:steps]
    if denominators is None:
        denominators = counts.clamp(min=1).float()
    weights = torch.tensor([step_weight ** k for k in range(steps)], device=ids.device,
                           dtype=torch.float32) / denominators
    teacher = Teacher(draft, batch, head, softcap, scale, accuracy, chunk, hard, teacher_topk)
    tokens = torch.cat([shift(ids, 1), ids.new_zeros(ids.shape[0], steps)], dim=1)
    hidden = draft.unroll_hidden(batch["aux_hidden"].to(draft.fc.weight.dtype), tokens, steps,
                                 batch.get("positions"), batch.get("docs"),
                                 batch.get("cu_seqlens"))
    xs = [draft.norm(hk.reshape(b * t, -1).index_select(0, select[k]))
          for k, hk in enumerate(hidden)]
    rows = [select[k] + 1 + k for k in range(steps)]
    want_grad = torch.is_grad_enabled()
    loss, ce, hits = FusedSoftCE.apply(teacher, rows, draft.d2t, weights, chunk, want_grad,
                                       draft.lm_head.weight, *xs)
    n = counts.clamp(min=1)
    out: Dict[str, torch.Tensor] = {"loss": loss}
    for k in range(steps):
        out[f"loss_{k}"], out[f"ce_{k}"], out[f"count_{k}"] = (ce[k] / n[k]).detach(), ce[k], counts[k]
        if accuracy:
            out[f"acc_{k}"] = hits[k].float() / n[k]
    if accuracy:
        out["accept_len"] = expected_accept_length([out[f"acc_{k}"] for k in range(steps)])
        out["verifier_choice"] = verifier_choice(teacher.greedy, ids, select[0])
    return out


def verifier_choice(greedy: torch.Tensor, ids: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """How many of step 0's trained positions t (flat indices `select`) read a next token
    the verifier itself would have written: its greedy token after x[..t+1] (`greedy`, per
    flat position) is the data's x[t+2], the token the draft's step 1 reads in training and
    the verifier's own choice wherever a served draft reads it. `valid_mask` keeps t + 2
    inside the sample, so x[t+2] is always there. A count on the device (no host sync)."""
    return (greedy.index_select(0, select + 1) == ids.reshape(-1).index_select(0, select + 2)).sum()


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
    hidden, cache = draft.combine(aux), []
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
