"""Where each stage's artifact lives for a config, and the fingerprint that keys it.

Defaults live in one shared store, ``<paths.artifacts>/<stage>/<fingerprint>``, so runs
and sweep jobs with the same inputs and settings reuse one another's work. An explicit
``*.output_dir`` / ``extract.prepared_data`` always wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from eagle3x import artifacts, verifier


def _abs(p: str | Path) -> Path:
    return Path(p).expanduser().absolute()


def verifier_fingerprint(cfg: Any) -> str:
    return verifier.fingerprint(cfg.verifier.path, tiny=cfg.verifier.tiny)


def prepare_settings(cfg: Any) -> Dict[str, Any]:
    """Everything that decides the prepared data, as json-able values."""
    return {"data": str(_abs(cfg.data.path)), "format": cfg.data.format.value,
            "seed": cfg.data.seed, "max_seq_len": cfg.extract.max_seq_len}


def prepared_fingerprint(cfg: Any) -> str:
    """Fingerprint of prepare's inputs: data content, tokenizer, seed, max_seq_len."""
    s = prepare_settings(cfg)
    return artifacts.digest({"data": artifacts.file_fingerprint(s["data"]),
                             "verifier": verifier_fingerprint(cfg),
                             **{k: v for k, v in s.items() if k != "data"}})


def prepared_dir(cfg: Any) -> Path:
    if cfg.extract.prepared_data:
        return _abs(cfg.extract.prepared_data)
    if cfg.prepare.output_dir:
        return _abs(cfg.prepare.output_dir)
    return _abs(cfg.paths.artifacts) / "prepared" / prepared_fingerprint(cfg)


def prepared_is_derived(cfg: Any) -> bool:
    return not (cfg.extract.prepared_data or cfg.prepare.output_dir)


def _prepared_id(cfg: Any) -> str:
    m = artifacts.complete_manifest(prepared_dir(cfg))
    return m["fingerprint"] if m else prepared_fingerprint(cfg)


def hidden_fingerprint(cfg: Any, aux_ids: List[int]) -> str:
    """Fingerprint of the hidden states: prepared data, verifier, aux layers, dtype.

    The sample count is not part of it: extraction grows a prefix of the prepared order.
    """
    return artifacts.digest({"prepared": _prepared_id(cfg), "verifier": verifier_fingerprint(cfg),
                             "aux_layer_ids": list(aux_ids), "dtype": cfg.extract.dtype.value})


def hidden_dir(cfg: Any, aux_ids: List[int]) -> Path:
    if cfg.extract.output_dir:
        return _abs(cfg.extract.output_dir)
    return _abs(cfg.paths.artifacts) / "hidden" / hidden_fingerprint(cfg, aux_ids)


def vocab_fingerprint(cfg: Any) -> str:
    return artifacts.digest({"prepared": _prepared_id(cfg), "num_samples": cfg.data.num_samples,
                             "holdout_samples": cfg.data.holdout_samples,
                             "draft_vocab_size": cfg.vocab.draft_vocab_size})


def vocab_dir(cfg: Any) -> Path:
    if cfg.vocab.output_dir:
        return _abs(cfg.vocab.output_dir)
    return _abs(cfg.paths.artifacts) / "vocab" / vocab_fingerprint(cfg)


def command_for(stage: str, overrides: List[str]) -> str:
    """The command line that runs `stage` with the same overrides."""
    kept = [o for o in overrides if not o.startswith("stage=")]
    return " ".join(["python -m eagle3x", f"stage={stage}", *kept])


def sample_split(cfg: Any, available: int) -> tuple:
    """(holdout_end, train_end): held-out samples are [0, holdout_end), training samples
    [holdout_end, train_end) of the prepared order."""
    from eagle3x.artifacts import ArtifactError

    hold = cfg.data.holdout_samples
    end = hold + cfg.data.num_samples if cfg.data.num_samples else available
    if end > available or hold >= available:
        raise ArtifactError(f"data.holdout_samples={hold} + data.num_samples={cfg.data.num_samples} "
                            f"need {max(end, hold + 1)} samples; the prepared data holds {available}")
    return hold, end


def run_dir(cfg: Any) -> Path:
    """Where train / eval / export write: train.output_dir, else this Hydra job's folder."""
    if cfg.train.output_dir:
        return _abs(cfg.train.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return _abs(HydraConfig.get().runtime.output_dir)
    except Exception:
        pass
    return _abs("outputs") / "train"
