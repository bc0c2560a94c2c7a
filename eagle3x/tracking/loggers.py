"""Experiment loggers for the train stage: W&B (default, offline-capable), CSV, or none."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from eagle3x.config.schema import LoggerConfig, LoggerName


def overrides() -> List[str]:
    """The command-line overrides of this Hydra job (empty outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    except Exception:
        return []


def run_name(default: str = "eagle3x") -> str:
    kept = [o for o in overrides() if not o.startswith(("stage=", "hydra", "paths."))]
    return ",".join(kept) or default


def sweep_group() -> Optional[str]:
    """The sweep folder name of a multirun job (its W&B group), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            if hc.mode is not None and hc.mode.name == "MULTIRUN":
                return Path(hc.sweep.dir).name
    except Exception:
        pass
    return None


def make_logger(settings: LoggerConfig, out: Path, config: Dict[str, Any],
                job_type: str = "train") -> Any:
    """A Lightning logger per `settings.name` (False for none); `config` is what the run
    logs as its configuration (the whole resolved config)."""
    if settings.name is LoggerName.none:
        return False
    if settings.name is LoggerName.csv:
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(out), name="csv", version="")
    from lightning.pytorch.loggers import WandbLogger

    tags = list(settings.tags) + [o for o in overrides() if not o.startswith("hydra")][:20]
    return WandbLogger(project=settings.project, entity=settings.entity, name=run_name(),
                       group=settings.group or sweep_group(), job_type=job_type,
                       tags=[t[:64] for t in tags], mode=settings.mode, save_dir=str(out),
                       config=config)
