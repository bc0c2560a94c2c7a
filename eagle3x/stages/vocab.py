"""Stage `vocab`: the draft vocabulary and the d2t / t2d maps vLLM and SGLang read.

The draft predicts over the `draft_vocab_size` most frequent trained target tokens
(assistant tokens of the training samples: the `data.num_samples` after the held-out ones;
ties go to the lower id). Draft ids are sorted by target id, and

    target_id = draft_id + d2t[draft_id]        t2d[target_id] = in the draft vocab

``vocab.safetensors`` holds ``d2t`` (int64 [draft]), ``t2d`` (bool [target]) and
``counts`` (int64 [target]).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Tuple

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
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
    d2t, t2d, filled = build_mapping(counts, plan.draft_vocab_size)
    if filled:
        log.warning("only %d distinct trained tokens: filled the draft vocab with the %d lowest "
                    "unused ids", plan.draft_vocab_size - filled, filled)
    covered = int(counts[t2d].sum())
    stats = {"draft_vocab_size": len(d2t), "target_vocab_size": target_size,
             "distinct_tokens": int((counts > 0).sum()), "filled": filled,
             "trained_tokens": int(counts.sum()),
             "coverage": covered / max(int(counts.sum()), 1), "samples": last - first}
    manifest = artifacts.new_manifest("vocab", plan.config, plan.vocab.fingerprint, stats=stats)
    with artifacts.building(out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(Path(tmp) / FILE))
        manifest["files"] = [artifacts.file_entry(Path(tmp) / FILE)]
        manifest["complete"] = True
        artifacts.write_json_atomic(Path(tmp) / artifacts.MANIFEST, manifest)
    log.info("draft vocab %d of %d tokens covers %.1f%% of trained tokens -> %s",
             len(d2t), target_size, 100 * stats["coverage"], out)
    return Outcome("vocab", "built", out)


def load(folder: str | Path) -> Dict[str, Any]:
    """d2t, t2d and counts (numpy) of a finished vocab folder."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    m = artifacts.read_manifest(folder)
    artifacts.verify_files(folder, m)
    return {"manifest": m, **load_file(str(artifacts.safe_member(folder, FILE)))}
