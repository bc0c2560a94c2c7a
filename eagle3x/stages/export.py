"""Stage `export`: write the vLLM / SGLang draft folder from a training checkpoint.

The checkpoint is `train.resume` when it names a file, else <run dir>/checkpoints/last.ckpt
(``plan.Resume.export_checkpoint``); it is loaded with weights_only=True.
"""

from __future__ import annotations

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import DraftConfig, TrainConfig, TrainerConfig
from eagle3x.plan import RunPlan


def run(plan: RunPlan, train: TrainConfig, trainer: TrainerConfig) -> Outcome:
    import torch

    from eagle3x.draft.save import save
    from eagle3x.stages.train import build_module

    ckpt = plan.resume.export_checkpoint(plan.run_dir)
    if not ckpt.is_file():
        raise artifacts.ArtifactError(f"{ckpt}: no checkpoint to export")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    # the architecture the checkpoint was trained with (its hyperparameters), not today's
    # draft.* settings, so a changed option cannot load half a draft
    shape = (saved.get("hyper_parameters") or {}).get("shape") or {}
    options = {k: shape[k] for k in DraftConfig().options() if k in shape}
    module = build_module(plan, train, trainer.max_steps, options)
    missing, unexpected = module.load_state_dict(saved["state_dict"], strict=False)
    lost = [k for k in missing if not k.startswith("draft.embed_tokens")] + list(unexpected)
    if lost:
        raise artifacts.ArtifactError(f"{ckpt}: does not hold this draft (missing or "
                                      f"unexpected weights: {', '.join(lost[:6])})")
    out = save(module.draft, plan.run_dir / "draft", list(plan.aux_layer_ids),
               include_embeddings=not train.freeze_embeddings,
               verifier_architectures=plan.verifier.info.architectures)
    return Outcome("draft", "built", out)
