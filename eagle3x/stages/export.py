"""Stage `export`: write the vLLM / SGLang draft folder from a training checkpoint.

The checkpoint is `train.resume` when it names a file, else <run dir>/checkpoints/last.ckpt;
it is loaded with weights_only=True.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from eagle3x import artifacts, layout


def run(cfg: DictConfig) -> str:
    import torch

    from eagle3x.draft.export import export
    from eagle3x.stages import vocab
    from eagle3x.stages.train import build_module

    out = layout.run_dir(cfg)
    ckpt = Path(cfg.train.resume) if cfg.train.resume not in ("auto", "none") else \
        out / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise artifacts.ArtifactError(f"{ckpt}: no checkpoint to export")
    module, plan = build_module(cfg, vocab.run(cfg))
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state, strict=False)
    return str(export(module.draft, out / "draft", plan.aux_ids,
                      include_embeddings=not cfg.train.freeze_embeddings))
