"""Stage `vocab`: the draft vocabulary and the d2t / t2d maps vLLM and SGLang read.

The draft predicts over the most frequent trained target tokens (assistant tokens of the
training samples: the `data.num_samples` after the held-out ones; ties go to the lower
id): `draft_vocab_size` of them, or with `vocab.draft_vocab_size=auto` the fewest whose
counts cover `vocab.coverage` of the trained tokens, at most `vocab.max_draft_vocab_size`
(`auto_size`). Draft ids are sorted by target id, and

    target_id = draft_id + d2t[draft_id]        t2d[target_id] = in the draft vocab

A fixed size larger than the distinct trained tokens is filled with the lowest unused ids;
when those fillers are most of the vocabulary (`mostly_unseen`) the stage warns, naming
the size auto would choose: their lm_head rows cost training and serving time and are
never a trained target. The manifest's stats record the sizes, the coverage of the
trained tokens and of the held-out samples' trained tokens (a token outside the draft
vocabulary can never be proposed), and how the size was chosen.

``vocab.safetensors`` holds ``d2t`` (int64 [draft]), ``t2d`` (bool [target]) and
``counts`` (int64 [target]).

With ``draft.init`` the published draft's own map is kept (its lm_head rows belong to
its tokens: rebuilding the map from new data would silently misalign every row, as
SpecForge's draft_checkpoint_path did before its PR #534), and the stage says so. With
``vocab.remap=true`` a new map is built from the data as above and the draft's lm_head
rows follow their tokens: ``rows`` (int64 [draft]) holds, for each new draft id, the
published draft's row of the same target token, or -1 for a token it did not have, whose
row starts from the verifier's lm_head row (what a from-scratch draft starts from,
``DraftModule``; zero would make every new token's first logits equal, and the verifier's
row is the best-known predictor of that token from a hidden state). The manifest's
stats record which (``mapping``: kept / remapped, ``kept_rows``, ``new_rows``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import AUTO
from eagle3x.data import prepared
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")
FILE = "vocab.safetensors"


def build_mapping(counts: Any, draft_size: int) -> Tuple[Any, Any, int]:
    """(d2t, t2d, filled) from token counts; `filled` ids were added without being seen."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    target_size = len(counts)
    if draft_size > target_size:
        raise ValueError(f"draft vocab {draft_size} > target vocab {target_size}")
    seen = np.flatnonzero(counts > 0)
    # Most frequent first, ties broken by the lower id (lexsort: last key is primary).
    ranked = seen[np.lexsort((seen, -counts[seen]))]
    chosen = ranked[:draft_size]
    filled = draft_size - len(chosen)
    if filled > 0:
        unused = np.setdiff1d(np.arange(target_size), chosen, assume_unique=True)
        chosen = np.concatenate([chosen, unused[:filled]])
    chosen = np.sort(chosen)
    d2t = (chosen - np.arange(draft_size)).astype(np.int64)
    t2d = np.zeros(target_size, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d, max(filled, 0)


def auto_size(counts: Any, coverage: float, cap: int) -> int:
    """The fewest most frequent tokens whose counts add up to at least `coverage` of all
    counts, at most `cap`; 1 when nothing is counted."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return 1
    ranked = np.sort(counts[counts > 0])[::-1]
    need = coverage * total
    n = int(np.searchsorted(np.cumsum(ranked), need - 1e-9 * total, side="left")) + 1
    return max(1, min(n, len(ranked), cap, len(counts)))


def chosen_size(counts: Any, size: Union[int, str], coverage: float, cap: int) -> int:
    """The draft vocabulary's size: `size`, or for "auto" `auto_size(counts, coverage, cap)`."""
    return auto_size(counts, coverage, cap) if size == AUTO else int(size)


def mostly_unseen(draft_size: int, distinct: int) -> bool:
    """More than half of a draft vocabulary of `draft_size` is never a trained token."""
    return draft_size - distinct > draft_size / 2


#: how far (in coverage of the trained tokens) a kept draft.init vocabulary may fall short
#: of what `auto` would reach before the stage warns
KEPT_SHORTFALL = 0.05


def kept_vocab_warning(size: int, coverage: float, auto_size: int,
                       auto_coverage: float) -> Optional[str]:
    """The warning for a draft.init vocabulary kept (`size` tokens covering `coverage` of
    this data's trained tokens) when `auto` would cover `auto_coverage` with `auto_size`
    tokens and the kept one falls more than KEPT_SHORTFALL short, else None. A token outside
    the draft's vocabulary can never be drafted, so such a draft's acceptance is capped
    whatever the fine-tune does (bench/RESULTS.md, issue 33: a 287-token vocabulary at 65%
    coverage reached 1.89 after 200 steps, the same draft re-mapped 2.53, from scratch 2.31)."""
    if coverage >= auto_coverage - KEPT_SHORTFALL:
        return None
    return (f"the vocabulary kept from draft.init ({size} tokens) covers {100 * coverage:.1f}% "
            f"of this data's trained tokens; vocab.draft_vocab_size=auto would take {auto_size} "
            f"tokens for {100 * auto_coverage:g}%. A token outside it is never drafted: "
            "vocab.remap=true re-maps the lm_head rows by token id (rows of tokens in both kept, "
            "new ones from the verifier's lm_head)")


def remap_rows(old_d2t: Any, new_d2t: Any) -> Any:
    """For each id of the new draft vocabulary, the old draft's row of the same target
    token, or -1 where the old vocabulary lacks it (int64 [new draft])."""
    import numpy as np

    old_targets = np.arange(len(old_d2t)) + np.asarray(old_d2t)
    row_of = {int(t): i for i, t in enumerate(old_targets)}
    new_targets = np.arange(len(new_d2t)) + np.asarray(new_d2t)
    return np.array([row_of.get(int(t), -1) for t in new_targets], dtype=np.int64)


def count_targets(prepared: Dict[str, Any], target_size: int, first: int, last: int) -> Any:
    """Counts of token ids on loss-masked positions of prepared samples [first, last)."""
    import numpy as np

    a, b = int(prepared["offsets"][first]), int(prepared["offsets"][last])
    ids = prepared["input_ids"][a:b]
    mask = prepared["loss_mask"][a:b].astype(bool)
    return np.bincount(ids[mask], minlength=target_size)[:target_size].astype(np.int64)


def run(plan: RunPlan) -> Outcome:
    """The draft vocabulary of the plan's training samples, built unless already there."""
    out = plan.vocab.folder
    if artifacts.reuse(out, plan.vocab.fingerprint, "the draft vocabulary"):
        log.info("reusing the draft vocabulary at %s (same inputs and settings)", out)
        return Outcome("vocab", "reused", out)
    from safetensors.numpy import save_file

    target_size = plan.verifier.info.vocab_size
    data = prepared.load(plan.prepared.folder)
    first, last = plan.split.bounds(data["n"])
    counts = count_targets(data, target_size, first, last)
    held = count_targets(data, target_size, 0, first)
    extra: Dict[str, Any] = {}
    if plan.init is not None and not plan.init.remap:
        from eagle3x import published

        d2t, t2d = published.d2t_t2d(published.read(plan.init.folder))
        size, filled = len(d2t), 0
    else:
        size = chosen_size(counts, plan.draft_vocab_size, plan.draft_vocab_coverage,
                           plan.draft_vocab_max)
        d2t, t2d, filled = build_mapping(counts, size)
    if plan.init is not None and plan.init.remap:
        from eagle3x import published

        old_d2t, _ = published.d2t_t2d(published.read(plan.init.folder))
        extra["rows"] = remap_rows(old_d2t, d2t)
    distinct = int((counts > 0).sum())
    auto = auto_size(counts, plan.draft_vocab_coverage, plan.draft_vocab_max)
    fixed = plan.draft_vocab_size != AUTO
    if filled and fixed and mostly_unseen(size, distinct):
        log.warning("vocab.draft_vocab_size=%d: the training samples show only %d distinct "
                    "trained tokens, so %d of the %d entries (%.0f%%) are never a trained target "
                    "(filled with the lowest unused ids); their lm_head rows cost training and "
                    "serving time. vocab.draft_vocab_size=auto chooses %d here (%.1f%% "
                    "coverage)", size, distinct, filled, size, 100 * filled / size, auto,
                    100 * plan.draft_vocab_coverage)
    elif filled:
        log.warning("only %d distinct trained tokens: filled the draft vocab with the %d lowest "
                    "unused ids", distinct, filled)
    covered = int(counts[t2d].sum())
    stats = {"draft_vocab_size": len(d2t), "target_vocab_size": target_size,
             "distinct_tokens": distinct, "filled": filled,
             "trained_tokens": int(counts.sum()),
             "coverage": covered / max(int(counts.sum()), 1), "samples": last - first,
             "size_rule": "fixed" if fixed else "auto",
             "auto_size": auto, "auto_coverage": plan.draft_vocab_coverage,
             "heldout_tokens": int(held.sum()),
             "heldout_coverage": (int(held[t2d].sum()) / int(held.sum())) if held.sum() else None}
    if plan.init is not None:
        stats.update(mapping="remapped" if plan.init.remap else "kept",
                     init=str(plan.init.folder), init_layout=plan.init.layout,
                     init_draft_vocab_size=plan.init.draft_vocab_size)
        if plan.init.remap:
            kept = int((extra["rows"] >= 0).sum())
            stats.update(kept_rows=kept, new_rows=len(d2t) - kept,
                         new_rows_from="the verifier's lm_head rows")
        stats["size_rule"] = "draft.init" if not plan.init.remap else stats["size_rule"]
        if not plan.init.remap:
            warn = kept_vocab_warning(len(d2t), stats["coverage"], auto, plan.draft_vocab_coverage)
            if warn:
                log.warning(warn)
    manifest = artifacts.new_manifest("vocab", plan.config, plan.vocab.fingerprint, stats=stats)
    with artifacts.building(out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts, **extra}, str(Path(tmp) / FILE))
        manifest["files"] = [artifacts.file_entry(Path(tmp) / FILE)]
        manifest["complete"] = True
        artifacts.write_json_atomic(Path(tmp) / artifacts.MANIFEST, manifest)
    how = ""
    if not fixed:
        capped = size == plan.draft_vocab_max and stats["coverage"] < plan.draft_vocab_coverage
        how = f" (auto: {100 * plan.draft_vocab_coverage:g}% coverage{', capped' if capped else ''})"
    held_part = (f", {100 * stats['heldout_coverage']:.1f}% of held-out ones"
                 if stats["heldout_coverage"] is not None else "")
    if plan.init is not None and not plan.init.remap:
        how = (f" (kept from the {plan.init.layout} draft of draft.init, its lm_head rows "
               f"aligned with their tokens; vocab.remap=true re-maps it to this data)")
    elif plan.init is not None:
        how += (f" (re-mapped from the draft of draft.init: {stats['kept_rows']} rows kept by "
                f"token id, {stats['new_rows']} new ones from the verifier's lm_head)")
    log.info("draft vocab %d of %d tokens%s covers %.1f%% of trained tokens%s -> %s",
             len(d2t), target_size, how, 100 * stats["coverage"], held_part, out)
    return Outcome("vocab", "built", out)


def load(folder: str | Path) -> Dict[str, Any]:
    """d2t, t2d and counts (numpy) of a finished vocab folder."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    m = artifacts.read_manifest(folder)
    artifacts.verify_files(folder, m)
    return {"manifest": m, **load_file(str(artifacts.safe_member(folder, FILE)))}
