"""Prepared data: conversations -> chat template -> token ids + assistant loss mask.

A folder holds ``prepared.safetensors`` (``input_ids`` int32 [T], ``loss_mask`` uint8 [T],
``offsets`` int64 [n+1], ``source_line`` int64 [n]) and ``manifest.json``. Samples are
stored in one seeded order, so ``data.num_samples=N`` always means the same first N.
``build`` makes it (or reuses a finished folder with the same fingerprint); ``load`` reads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional

from eagle3x import artifacts, console
from eagle3x.artifacts import Outcome
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")
FILE = "prepared.safetensors"


def build(plan: RunPlan) -> Outcome:
    """The prepared data of `plan` at ``plan.prepared.folder``, built unless already there."""
    out = plan.prepared.folder
    if artifacts.reuse(out, plan.prepared.fingerprint, "prepared data"):
        log.info("reusing prepared data at %s (same inputs and settings)", out)
        return Outcome("prepared", "reused", out)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    # Several workers of a data-parallel extraction start together: one builds, the
    # others wait here and reuse it (never replacing a folder another one is reading).
    with FileLock(str(out.parent / f".{out.name}.prepare.lock")):
        if artifacts.reuse(out, plan.prepared.fingerprint, "prepared data"):
            log.info("reusing prepared data at %s (built meanwhile by another process)", out)
            return Outcome("prepared", "reused", out)
        return _build(plan)


def _build(plan: RunPlan) -> Outcome:
    out = plan.prepared.folder
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from eagle3x.data.chat import encode
    from eagle3x.data.conversations import iter_conversations
    from eagle3x.verifier import load_tokenizer

    src = plan.source
    tok = load_tokenizer(plan.verifier.path, plan.verifier.trust_remote_code)
    convs = list(iter_conversations(src.path, src.format))
    order = np.random.default_rng(src.seed).permutation(len(convs))
    where = str(src.path)
    ids, masks, lengths, lines = [], [], [], []
    truncated = dropped = 0
    for k in tqdm(order, desc="prepare", unit="conv", disable=len(convs) < 2000,
                  file=console.stream()):
        conv = convs[k]
        t_ids, t_mask, cut = encode(tok, conv.messages, src.max_seq_len, f"{where}:{conv.line}",
                                    src.template_kwargs)
        if not any(t_mask):
            dropped += 1  # truncation removed every assistant token
            continue
        truncated += cut
        ids.append(np.asarray(t_ids, dtype=np.int32))
        masks.append(np.asarray(t_mask, dtype=np.uint8))
        lengths.append(len(t_ids))
        lines.append(conv.line)
    if not ids:
        raise artifacts.ArtifactError(f"{where}: no sample keeps an assistant token within "
                                      f"extract.max_seq_len={src.max_seq_len}")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    all_mask = np.concatenate(masks)
    stats: Dict[str, Any] = {
        "samples": len(ids), "tokens": int(offsets[-1]), "loss_tokens": int(all_mask.sum()),
        "truncated": truncated, "dropped_no_assistant_token": dropped,
        "mean_tokens": float(np.mean(lengths)), "max_tokens": int(max(lengths)),
        "input_conversations": len(convs),
    }
    manifest = artifacts.new_manifest("prepared", plan.config, plan.prepared.fingerprint,
                                      stats=stats, settings=src.settings(),
                                      tokenizer_vocab_size=len(tok))
    with artifacts.building(out) as tmp:
        save_file({"input_ids": np.concatenate(ids), "loss_mask": all_mask, "offsets": offsets,
                   "source_line": np.asarray(lines, dtype=np.int64)}, str(Path(tmp) / FILE))
        manifest["files"] = [artifacts.file_entry(Path(tmp) / FILE)]
        manifest["complete"] = True
        artifacts.write_json_atomic(Path(tmp) / artifacts.MANIFEST, manifest)
    log.info("prepared %d samples, %d tokens (%d trained), %d truncated, %d dropped -> %s",
             stats["samples"], stats["tokens"], stats["loss_tokens"], truncated, dropped, out)
    return Outcome("prepared", "built", out)


def load(folder: str | Path, num_samples: Optional[int] = None, verify: bool = False) -> Dict[str, Any]:
    """Open prepared data (numpy arrays), optionally only its first `num_samples`."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    m = artifacts.read_manifest(folder)
    if not m.get("complete"):
        raise artifacts.ArtifactError(f"{folder / artifacts.MANIFEST}: unfinished prepared data")
    artifacts.verify_files(folder, m, full=verify)
    try:
        t = load_file(str(artifacts.safe_member(folder, FILE)))
    except Exception as exc:
        raise artifacts.ArtifactError(f"{folder / FILE}: cannot be read as safetensors ({exc})")
    n = len(t["offsets"]) - 1
    if num_samples is not None and num_samples > n:
        raise artifacts.ArtifactError(f"{folder}: data.num_samples={num_samples} but the prepared "
                                      f"data holds {n} samples")
    return {"manifest": m, "n": n if num_samples is None else num_samples, **t}
