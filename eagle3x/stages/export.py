"""Stage `export`: write the draft folders (`export.format`) from a training checkpoint, or
convert a published draft (`draft.init`) without training.

The checkpoint is `train.resume` when it names a file, else <run dir>/checkpoints/last.ckpt
(``plan.Resume.export_checkpoint``); it is loaded with weights_only=True. With draft.init
and no such checkpoint, the published draft itself is written, its own vocabulary map
kept (no data is read). The first format lands in <run dir>/draft, each other one in
<run dir>/draft-<format> (`write_formats`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import DraftConfig, ExportConfig, TrainConfig, TrainerConfig
from eagle3x.plan import RunPlan


def write_formats(draft: object, plan: RunPlan, formats: list, include_embeddings: bool) -> Path:
    """Write `draft` in every format of `formats` (draft.save.write_formats) for this plan;
    the first folder."""
    from eagle3x.draft.save import write_formats as write

    return write(draft, plan.run_dir, formats, list(plan.aux_layer_ids),
                 include_embeddings=include_embeddings,
                 verifier_architectures=plan.verifier.info.architectures,
                 verifier=str(plan.verifier.path))

log = logging.getLogger("eagle3x")


def run(plan: RunPlan, train: TrainConfig, trainer: TrainerConfig,
        export: ExportConfig = ExportConfig(), draft: DraftConfig = DraftConfig()) -> Outcome:
    import torch

    from eagle3x.stages.train import build_module

    formats = [f.value for f in export.format]
    ckpt = plan.resume.export_checkpoint(plan.run_dir)
    if plan.init is not None and not ckpt.is_file():
        from eagle3x import published
        from eagle3x.draft.save import load_published
        from eagle3x.weights import EMBED_NAMES, find_tensor

        p = published.read(plan.init.folder)
        module = load_published(p, find_tensor(plan.verifier.path, EMBED_NAMES))
        log.info("converting the %s draft at %s (no checkpoint in %s)", p.layout, p.folder,
                 plan.run_dir / "checkpoints")
        out = write_formats(module, plan, formats,
                            include_embeddings=p.has_embeddings and not train.freeze_embeddings)
        return Outcome("draft", "built", out)
    if not ckpt.is_file():
        raise artifacts.ArtifactError(f"{ckpt}: no checkpoint to export")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    # the architecture the checkpoint was trained with (its hyperparameters), not today's
    # draft.* settings, so a changed option cannot load half a draft
    shape = (saved.get("hyper_parameters") or {}).get("shape") or {}
    options = {k: shape[k] for k in DraftConfig().options() if k in shape}
    module = build_module(plan, train, trainer.max_steps, options, load_init=False)
    missing, unexpected = module.load_state_dict(saved["state_dict"], strict=False)
    lost = [k for k in missing if not k.startswith("draft.embed_tokens")] + list(unexpected)
    if lost:
        raise artifacts.ArtifactError(f"{ckpt}: does not hold this draft (missing or "
                                      f"unexpected weights: {', '.join(lost[:6])})")
    out = write_formats(module.draft, plan, formats,
                        include_embeddings=not train.freeze_embeddings)
    return Outcome("draft", "built", out)
