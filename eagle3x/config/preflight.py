"""Checks run on the composed config before anything heavy is imported.

`check_values` looks at the config alone (ranges, required keys); `preflight` looks at
the world: input files, the verifier folder, output folders, free disk, visible GPUs.
Both return every problem they find, so one run shows them all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from eagle3x import artifacts, layout
from eagle3x.config.problems import Problem
from eagle3x.data.conversations import check_source, count_records
from eagle3x.verifier import VerifierInfo, aux_layers, read_info

#: Stages whose inputs are built by the run itself when missing.
SELF_BUILDING = ("all", "train", "eval")
#: Bytes per stored hidden value, by extract.dtype.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

_RULES: List[Tuple[str, Callable[[Any], bool], str]] = [
    ("extract.batch_size", lambda v: v >= 1, "must be at least 1"),
    ("extract.max_seq_len", lambda v: v >= 2, "must be at least 2"),
    ("extract.shard_tokens", lambda v: v >= 1, "must be at least 1"),
    ("extract.aux_layer_ids", lambda v: v is None or (len(v) == 3 and min(v) >= 0),
     "must be three layer ids >= 0 (low, middle, high), or null for the default"),
    ("engine.tensor_parallel_size", lambda v: v >= 1, "must be at least 1"),
    ("engine.gpu_memory_utilization", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("engine.max_num_batched_tokens", lambda v: v is None or v >= 1, "must be at least 1"),
    ("data.num_samples", lambda v: v is None or v >= 1, "must be at least 1, or null for all"),
    ("data.holdout_samples", lambda v: v >= 0, "must be 0 or more"),
    ("vocab.draft_vocab_size", lambda v: v >= 1, "must be at least 1"),
    ("train.ttt_steps", lambda v: v >= 1, "must be at least 1"),
    ("train.step_weight", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("train.lr", lambda v: v > 0, "must be positive"),
    ("train.warmup_steps", lambda v: v >= 0, "must be 0 or more"),
    ("train.batch_size", lambda v: v >= 1, "must be at least 1"),
    ("train.num_workers", lambda v: v >= 0, "must be 0 or more"),
    ("trainer.max_steps", lambda v: v >= 1 or v == -1, "must be at least 1 (or -1: epochs decide)"),
    ("trainer.max_epochs", lambda v: v is None or v >= 1, "must be at least 1"),
    ("trainer.accumulate_grad_batches", lambda v: v >= 1, "must be at least 1"),
    ("trainer.log_every_n_steps", lambda v: v >= 1, "must be at least 1"),
    ("eval.depth", lambda v: v >= 1, "must be at least 1"),
    ("eval.max_samples", lambda v: v >= 1, "must be at least 1"),
    ("logger.mode", lambda v: v in ("online", "offline", "disabled"),
     "must be online, offline or disabled"),
]


def check_values(cfg: DictConfig, need_stage: bool = True) -> List[Problem]:
    """Problems visible in the config alone: missing required keys and out-of-range values."""
    problems: List[Problem] = []
    if need_stage and OmegaConf.is_missing(cfg, "stage"):
        from eagle3x.config.schema import Stage

        problems.append(Problem("stage", "no stage given.",
                                hint="choose one: " + ", ".join(f"stage={s.name}" for s in Stage)))
    job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    for key in sorted(OmegaConf.missing_keys(job_cfg)):
        if key != "stage":
            problems.append(Problem(key, "required, and not set.",
                                    hint=f"set it on the command line: {key}=..."))
    for key, ok, why in _RULES:
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=True)
        except Exception:
            continue
        if isinstance(value, DictConfig) or not _safe(ok, value):
            problems.append(Problem(key, why + ".", value=_show(value)))
    return problems


def _safe(ok: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(ok(value))
    except TypeError:
        return False


def _show(value: Any) -> str:
    return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)


def visible_gpus() -> int:
    """CUDA GPUs this process may use, read without torch.

    EAGLE3X_GPU_COUNT overrides (tests, or machines without /proc/driver/nvidia).
    """
    forced = os.environ.get("EAGLE3X_GPU_COUNT")
    if forced is not None:
        return int(forced)
    proc = Path("/proc/driver/nvidia/gpus")
    physical = len(list(proc.iterdir())) if proc.is_dir() else 0
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return physical
    listed = [d for d in mask.split(",") if d.strip() and d.strip() != "-1"]
    return min(len(listed), physical)


def free_bytes(path: Path) -> int:
    """Free disk at `path`'s nearest existing folder (EAGLE3X_FREE_BYTES overrides, for tests)."""
    forced = os.environ.get("EAGLE3X_FREE_BYTES")
    if forced is not None:
        return int(forced)
    return shutil.disk_usage(_existing_ancestor(path)).free


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p


def _writable(path: Path) -> bool:
    base = _existing_ancestor(path)
    return base.is_dir() and os.access(base, os.W_OK)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def read_verifier(cfg: DictConfig) -> Tuple[Optional[VerifierInfo], List[Problem]]:
    """Verifier facts from config.json (or the tiny spec before it is built)."""
    path = Path(cfg.verifier.path).expanduser()
    if cfg.verifier.tiny and not (path / "config.json").exists():
        from eagle3x.tiny import config_dict

        return VerifierInfo.from_config(config_dict()), []
    if not path.is_dir():
        return None, [Problem("verifier.path", "not a folder.", value=str(path),
                              hint="point it at a Hugging Face model folder (config.json, "
                                   "*.safetensors, tokenizer files)")]
    try:
        info = read_info(path)
    except FileNotFoundError:
        return None, [Problem("verifier.path", f"no config.json in {path}.", value=str(path))]
    except (ValueError, KeyError, TypeError) as exc:
        return None, [Problem("verifier.path", f"{path / 'config.json'} is not a usable model "
                                               f"config ({type(exc).__name__}: {exc}).",
                              value=str(path))]
    problems = []
    if not any(path.glob("*.safetensors")):
        problems.append(Problem("verifier.path", f"no *.safetensors weights in {path}.",
                                value=str(path),
                                hint="eagle3x reads safetensors only (never pickled .bin files)"))
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
        problems.append(Problem("verifier.path", f"no tokenizer (tokenizer.json) in {path}.",
                                value=str(path)))
    return info, problems


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists():
        return True
    try:
        import json

        with open(path / "tokenizer_config.json", encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def preflight(cfg: DictConfig, overrides: Sequence[str] = ()) -> List[Problem]:
    """Problems in the world the run would meet; checked for cfg.stage."""
    stage = cfg.stage.value
    builds_inputs = stage in SELF_BUILDING
    problems: List[Problem] = []

    info, vproblems = read_verifier(cfg)
    problems += vproblems
    vpath = Path(cfg.verifier.path).expanduser()
    if info and not cfg.verifier.tiny and stage in ("prepare", *SELF_BUILDING) \
            and not has_chat_template(vpath):
        problems.append(Problem("verifier.path", f"the tokenizer in {vpath} has no chat template.",
                                value=str(vpath),
                                hint="add chat_template.jinja, or use the instruct/chat model"))

    data_ok = True
    if stage in ("prepare", *SELF_BUILDING) or layout.prepared_is_derived(cfg):
        why = check_source(cfg.data.path, cfg.data.format.value)
        if why:
            data_ok = False
            problems.append(Problem("data.path", why if ":" in why else f"{cfg.data.path} {why}.",
                                    value=str(cfg.data.path)))
    if data_ok:
        n = count_records(cfg.data.path) if Path(cfg.data.path).is_file() else None
        hold, want = cfg.data.holdout_samples, cfg.data.num_samples or 1
        # prepare reads every conversation; the held-out/training split binds later stages.
        split_matters = stage != "prepare" or cfg.data.num_samples is not None
        if n is not None and split_matters and hold + want > n:
            key = "data.num_samples" if cfg.data.num_samples else "data.holdout_samples"
            problems.append(Problem(key, f"asks for {hold} held-out + {want} training samples "
                                    f"but {cfg.data.path} holds {n}.",
                                    value=str(cfg.data.num_samples or hold)))

    ids: List[int] = []
    bad: List[int] = []
    if info:
        ids = aux_layers(cfg.extract.aux_layer_ids, info.num_layers)
        bad = [i for i in ids if not 0 <= i < info.num_layers]
        if bad:
            problems.append(Problem("extract.aux_layer_ids",
                                    f"layer ids {bad} are out of range: the verifier has "
                                    f"{info.num_layers} layers (ids 0..{info.num_layers - 1}).",
                                    value=str(ids)))
        if cfg.vocab.draft_vocab_size > info.vocab_size:
            problems.append(Problem("vocab.draft_vocab_size",
                                    f"larger than the verifier's vocabulary ({info.vocab_size}).",
                                    value=str(cfg.vocab.draft_vocab_size)))

    tp = cfg.engine.tensor_parallel_size
    if stage in ("extract", *SELF_BUILDING):
        gpus = visible_gpus()
        if tp > 1 and tp > gpus:
            problems.append(Problem("engine.tensor_parallel_size",
                                    f"{tp} ranks, but this machine shows {gpus} GPU(s).",
                                    value=str(tp), hint=f"use at most {max(gpus, 1)}"))
        if cfg.engine.name.value == "hf" and tp > 1:
            problems.append(Problem("engine.tensor_parallel_size",
                                    "the hf engine runs on one device; use engine=vllm for "
                                    "tensor parallelism.", value=str(tp)))

    if stage in ("train", "all"):
        problems += _train_checks(cfg)

    # Inputs the stage reads but does not build itself.
    if data_ok and not builds_inputs and stage in ("extract", "vocab"):
        prepared = layout.prepared_dir(cfg)
        if artifacts.complete_manifest(prepared) is None:
            hint = None
            if layout.prepared_is_derived(cfg):
                hint = "make it first:  " + layout.command_for("prepare", list(overrides))
            key = "extract.prepared_data"
            problems.append(Problem(key, f"no prepared data at {prepared}.", value=None, hint=hint))

    if data_ok and info:
        outs = []
        if stage in ("prepare", *SELF_BUILDING):
            outs.append(("prepare.output_dir", layout.prepared_dir(cfg)))
        if stage in ("extract", *SELF_BUILDING):
            outs.append(("extract.output_dir", layout.hidden_dir(cfg, ids)))
        for key, path in outs:
            if not _writable(path):
                base = _existing_ancestor(path)
                why = "is not a folder" if not base.is_dir() else "is not writable"
                problems.append(Problem(key, f"cannot write there: {base} {why}.",
                                        value=str(path)))
        if stage in ("extract", *SELF_BUILDING) and not bad:
            problems += _foreign_shards(cfg, ids)
            problems += _disk_check(cfg, info, layout.hidden_dir(cfg, ids))
    return problems


def _foreign_shards(cfg: DictConfig, ids: List[int]) -> List[Problem]:
    """An explicit extract.output_dir holding shards of another verifier/layers/data."""
    if not cfg.extract.output_dir:
        return []
    out = layout.hidden_dir(cfg, ids)
    try:
        have = artifacts.read_manifest(out).get("fingerprint")
    except artifacts.ArtifactError:
        return []
    want = layout.hidden_fingerprint(cfg, ids)
    if have == want:
        return []
    return [Problem("extract.output_dir", f"{out} holds hidden states of another verifier, aux "
                    "layers, dtype or prepared data; eagle3x will not mix them.", value=str(out),
                    hint="choose another extract.output_dir, or run with the settings that made it")]


def _train_checks(cfg: DictConfig) -> List[Problem]:
    import importlib.util

    problems = []
    if cfg.logger.name.value == "wandb" and importlib.util.find_spec("wandb") is None:
        problems.append(Problem("logger", "wandb is not installed.", value="wandb",
                                hint="pip install 'eagle3x[wandb]', or choose logger=csv / logger=none"))
    r = cfg.train.resume
    if r not in ("auto", "none") and not Path(r).is_file():
        problems.append(Problem("train.resume", f"no checkpoint file at {r}.", value=r,
                                hint="auto (this run folder's last.ckpt), none, or a .ckpt path"))
    return problems


def estimate_tokens(cfg: DictConfig) -> Tuple[int, str]:
    """Tokens extraction will store, and how the figure was obtained."""
    m = artifacts.complete_manifest(layout.prepared_dir(cfg))
    if m:
        stats = m["stats"]
        n = min((cfg.data.num_samples or stats["samples"]) + cfg.data.holdout_samples,
                stats["samples"])
        return int(stats["tokens"] * n / max(stats["samples"], 1)), "from the prepared data"
    # No prepared data yet: about 3.5 characters a token, read from the first records.
    from eagle3x.data.conversations import iter_conversations

    chars, seen = 0, 0
    try:
        for conv in iter_conversations(cfg.data.path, cfg.data.format.value, limit=200):
            chars += sum(len(m["content"]) + 8 for m in conv.messages)
            seen += 1
    except Exception:
        return 0, "unknown"
    if not seen:
        return 0, "unknown"
    total = (cfg.data.num_samples + cfg.data.holdout_samples if cfg.data.num_samples
             else count_records(cfg.data.path) or seen)
    per = min(chars / seen / 3.5, cfg.extract.max_seq_len)
    return int(per * total), "estimated from the conversations"


def _disk_check(cfg: DictConfig, info: VerifierInfo, out: Path) -> List[Problem]:
    tokens, how = estimate_tokens(cfg)
    per_token = 4 * info.hidden_size * DTYPE_BYTES[cfg.extract.dtype.value]
    need = tokens * per_token
    have_m = artifacts.complete_manifest(out) if out.exists() else None
    if have_m:
        need = max(0, need - sum(s["bytes"] for s in have_m.get("shards", [])))
    free = free_bytes(out)
    if need > free:
        return [Problem("extract.output_dir",
                        f"not enough disk: hidden states need about {human_bytes(need)} "
                        f"({tokens} tokens x 4 x {info.hidden_size} x "
                        f"{DTYPE_BYTES[cfg.extract.dtype.value]} bytes, {how}), "
                        f"{human_bytes(free)} free at {_existing_ancestor(out)}.",
                        value=str(out),
                        hint="free space, pick another extract.output_dir / paths.artifacts, "
                             "fewer data.num_samples, or extract.dtype=bfloat16")]
    return []
