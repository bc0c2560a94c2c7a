"""Stage `export`: write the vLLM / SGLang draft folder from a training checkpoint.

The checkpoint is `train.resume` when it names a file, else <run dir>/checkpoints/last.ckpt
(``plan.Resume.export_checkpoint``); it is loaded with weights_only=True.
"""

from __future__ import annotations

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import TrainConfig, TrainerConfig
from eagle3x.plan import RunPlan


def run(plan: RunPlan, train: TrainConfig, trainer: TrainerConfig) -> Outcome:
    import torch

    from eagle3x.draft.save import save
    from eagle3x.stages.train import build_module

    ckpt = plan.resume.export_checkpoint(plan.run_dir)
    if not ckpt.is_file():
        raise artifacts.ArtifactError(f"{ckpt}: no checkpoint to export")
    module = build_module(plan, train, trainer.max_steps)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state, strict=False)
    out = save(module.draft, plan.run_dir / "draft", list(plan.aux_layer_ids),
               include_embeddings=not train.freeze_embeddings,
               verifier_architectures=plan.verifier.info.architectures)
    return Outcome("draft", "built", out)
