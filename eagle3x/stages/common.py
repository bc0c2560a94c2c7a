"""Helpers the stages share: the verifier folder, the tokenizer, reuse of finished artifacts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from eagle3x import artifacts

log = logging.getLogger("eagle3x")


def verifier_path(cfg: DictConfig) -> Path:
    """The verifier folder, building the embedded tiny one first when configured."""
    path = Path(cfg.verifier.path).expanduser()
    if cfg.verifier.tiny:
        from eagle3x import tiny

        if not (path / "model.safetensors").exists():
            log.info("building the embedded tiny verifier at %s", path)
        tiny.build(path)
    return path


def load_tokenizer(cfg: DictConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verifier_path(cfg)),
                                         trust_remote_code=cfg.verifier.trust_remote_code)


def plain_config(cfg: DictConfig) -> Dict[str, Any]:
    """The resolved config without Hydra's own node, for manifests and loggers."""
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    data.pop("hydra", None)
    return data


def reusable(folder: Path, fingerprint: str, what: str) -> Optional[Dict[str, Any]]:
    """The manifest of a finished artifact with this fingerprint, or None to build it.

    A finished artifact made from other inputs is never overwritten: ArtifactError.
    """
    m = artifacts.complete_manifest(folder)
    if m is None:
        return None
    if m.get("fingerprint") != fingerprint:
        raise artifacts.ArtifactError(
            f"{folder / artifacts.MANIFEST}: holds {what} made from other inputs or settings "
            f"(fingerprint {m.get('fingerprint')}, this run needs {fingerprint}); "
            "choose another output folder or remove it")
    log.info("reusing %s at %s (same inputs and settings)", what, folder)
    note(m.get("kind", what), "reused", folder)
    return m


#: What this process built or reused, in order: (artifact kind, "built"|"reused", path).
EVENTS: List[Tuple[str, str, str]] = []


def note(kind: str, status: str, path: Any) -> None:
    EVENTS.append((kind, status, str(path)))
