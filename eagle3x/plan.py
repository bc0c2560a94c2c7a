"""The resolved plan of one run: what every stage reads and writes, computed once.

``resolve(settings)`` turns a validated config into a frozen ``RunPlan``: the verifier
(path, shape facts from config.json, fingerprint), the aux layer ids, the conversations and
their fingerprint, each artifact's folder and fingerprint, the held-out/training split and
the run folder. Stages take the plan plus the typed settings they own; nothing below the
stage boundary reads the config again. Preflight resolves the same plan to check the world,
and ``python -m eagle3x --plan ...`` prints it.

Fingerprints key the shared artifact store (``<paths.artifacts>/<kind>/<fingerprint>``):

    regenerated  data content, format, verifier, regenerate.* settings, chat_template_kwargs
    prepared  data content (or the regenerated artifact's fingerprint; a hub dataset's
              name, config, split and commit), verifier (config + tokenizer), format, seed,
              max_seq_len, the prepare format version, and when not the default
              chat_template_kwargs, data.fields, split_turns, train_reasoning,
              train_tool_calls
    hidden    prepared data, verifier, aux layer ids, stored dtype, storage format when
              not the default (not the sample count: extraction grows a prefix of the
              prepared order)
    vocab     prepared data, holdout_samples, num_samples, draft_vocab_size (auto: coverage, max)

An explicit folder (``prepare.output_dir``, ``extract.prepared_data``, ``extract.output_dir``,
``vocab.output_dir``) always wins over the store. This module imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from eagle3x import artifacts, verifier
from eagle3x.families import describe as describe_family
from eagle3x.hub import hub_source
from eagle3x.config.schema import AUTO, Eagle3xConfig, Responses, Stage
from eagle3x.verifier import VerifierInfo


#: The regenerated conversations inside their artifact folder (messages jsonl).
REGENERATED = "conversations.jsonl"


#: How hidden states are stored unless extract.aux_format / extract.teacher say otherwise.
DEFAULT_FORMAT = {"aux": "native", "teacher": "hidden"}


def storage_format(extract: Any) -> Dict[str, Any]:
    """The hidden-state storage format of these extract settings (data/compact.py)."""
    fmt: Dict[str, Any] = {"aux": extract.aux_format.value, "teacher": extract.teacher.value}
    if fmt["teacher"] == "topk":
        fmt["topk"] = extract.topk
    return fmt


class PlanError(artifacts.ArtifactError):
    """The plan cannot be resolved (an input is missing); `key` is the setting to fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


def _abs(p: str | Path) -> Path:
    return Path(p).expanduser().absolute()


@dataclass(frozen=True)
class VerifierRef:
    """The verifier this run reads: its folder, config.json facts and fingerprint."""

    path: Path
    tiny: bool
    trust_remote_code: bool
    fingerprint: str
    info: VerifierInfo = field(repr=False)

    @property
    def tied_head(self) -> bool:
        return self.info.tied

    @property
    def rms_norm_eps(self) -> float:
        return float(self.info.raw.get("rms_norm_eps", 1e-6))


#: What prepare makes of the same inputs and settings; in the prepared fingerprint, so an
#: artifact of an earlier format is never reused (2: tool calls, reasoning, text parts).
PREPARE_VERSION = 2


@dataclass(frozen=True)
class Source:
    """The conversations and the settings prepare applies to them."""

    #: a jsonl file or a datasets folder (None for a hub dataset)
    path: Optional[Path]
    format: str
    seed: int
    max_seq_len: int
    #: content fingerprint of the file or folder (of the regenerated artifact, for
    #: regenerated replies; of name, config, split and commit for a hub dataset); None
    #: when it cannot be read
    fingerprint: Optional[str]
    #: extra chat-template arguments (data.chat_template_kwargs)
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    #: a hub dataset (data.name), its config, split, and the commit this run reads
    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    revision: Optional[str] = None
    #: the hub dataset is read from the local datasets cache
    cached: bool = False
    #: data.fields that are set (column names)
    fields: Dict[str, str] = field(default_factory=dict)
    train_reasoning: bool = True
    train_tool_calls: bool = True
    split_turns: bool = False
    #: how prepare works (not what it makes): tokenizer processes, conversations per chunk
    num_proc: int = 1
    chunk_size: int = 4096
    #: conversations in the input when known before reading it (jsonl: its records)
    records: Optional[int] = None

    @property
    def label(self) -> str:
        """The source as messages name it (file path, folder, or hub name)."""
        return self.name if self.name else str(self.path)

    def settings(self) -> Dict[str, Any]:
        """What decides the prepared data, as json (recorded in its manifest)."""
        if self.name:
            out: Dict[str, Any] = {"data": self.name, "config": self.config, "split": self.split,
                                   "revision": self.revision}
        else:
            out = {"data": str(self.path)}
        out.update(format=self.format, seed=self.seed, max_seq_len=self.max_seq_len)
        # each key absent when at its default: fingerprints of other settings stay valid
        if self.template_kwargs:
            out["chat_template_kwargs"] = dict(self.template_kwargs)
        if self.fields:
            out["fields"] = dict(self.fields)
        if not self.train_reasoning:
            out["train_reasoning"] = False
        if not self.train_tool_calls:
            out["train_tool_calls"] = False
        if self.split_turns:
            out["split_turns"] = True
        return out


@dataclass(frozen=True)
class ArtifactRef:
    """One artifact of the store: where it lives and the fingerprint this run needs there."""

    kind: str
    folder: Path
    #: fingerprint of the inputs and settings that make it; None when an input is unreadable
    fingerprint: Optional[str]
    #: the user named the folder (else it is the store's folder for the fingerprint)
    explicit: bool


@dataclass(frozen=True)
class Split:
    """Held-out samples are [0, holdout) of the prepared order; training samples the next
    `num_samples` (None: all the rest). `min_samples` lets a sweep's first job extract for all."""

    holdout: int
    num_samples: Optional[int]
    min_samples: Optional[int] = None

    def bounds(self, available: int) -> Tuple[int, int]:
        """(holdout_end, train_end) within `available` prepared samples, or ArtifactError."""
        end = self.holdout + self.num_samples if self.num_samples else available
        if end > available or self.holdout >= available:
            raise artifacts.ArtifactError(
                f"data.holdout_samples={self.holdout} + data.num_samples={self.num_samples} "
                f"need {max(end, self.holdout + 1)} samples; the prepared data holds {available}")
        return self.holdout, end

    def extract_until(self, available: int) -> int:
        """How many samples of the prepared order extraction must hold."""
        _, end = self.bounds(available)
        if self.num_samples is not None and self.min_samples:
            end = min(max(end, self.holdout + self.min_samples), available)
        return end


@dataclass(frozen=True)
class Resume:
    """`train.resume`, read in one place: "auto" (the run folder's last.ckpt when it exists),
    "none", or the path of a checkpoint file."""

    mode: str  # "auto" | "none" | "path"
    path: Optional[Path] = None

    @classmethod
    def parse(cls, value: str) -> "Resume":
        if value in ("auto", "none"):
            return cls(value)
        return cls("path", Path(value).expanduser())

    def problem(self) -> Optional[str]:
        """Why this setting cannot work, or None."""
        if self.mode == "path" and not self.path.is_file():
            return f"no checkpoint file at {self.path}."
        return None

    def training_checkpoint(self, run_dir: Path) -> Optional[Path]:
        """The checkpoint training continues from (None: start fresh)."""
        if self.mode == "none":
            return None
        if self.mode == "path":
            if not self.path.is_file():
                raise artifacts.ArtifactError(f"train.resume={self.path}: no such checkpoint file")
            return self.path
        last = last_checkpoint(run_dir)
        return last if last.exists() else None

    def export_checkpoint(self, run_dir: Path) -> Path:
        """The checkpoint `stage=export` writes a draft from."""
        return self.path if self.mode == "path" else last_checkpoint(run_dir)


def last_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"


@dataclass(frozen=True)
class InitRef:
    """The published draft `draft.init` names (eagle3x.published), as the plan needs it."""

    folder: Path
    layout: str
    #: its vocabulary's size, and whether the vocab stage re-maps it (vocab.remap)
    draft_vocab_size: int
    remap: bool
    #: its aux layer ids in eagle3x's numbering, None where the folder names none
    aux_layer_ids: Optional[Tuple[int, ...]]
    #: config.json and the stored d2t / t2d bytes
    fingerprint: str


def read_init(init: str, remap: bool) -> InitRef:
    """The InitRef of `draft.init`; PlanError naming draft.init when it cannot be read."""
    from eagle3x import published

    try:
        folder = published.locate(init)
        p = published.read(folder)
    except (published.LayoutError, OSError) as exc:
        raise PlanError("draft.init", str(exc)) from None
    parts = [(folder / "config.json").read_bytes()]
    for stored, name in sorted(p.names.items()):
        if name in ("d2t", "t2d"):
            e = p.index[stored]
            with open(e.file, "rb") as f:
                f.seek(e.start)
                parts.append(f.read(e.end - e.start))
    fp = hashlib.sha256(b"".join(hashlib.sha256(x).digest() for x in parts)).hexdigest()[:16]
    return InitRef(folder, p.layout, int(p.shape["draft_vocab_size"]), remap,
                   p.aux_layer_ids, fp)


@dataclass(frozen=True)
class RunPlan:
    """Everything one run reads and writes, resolved once from the validated config."""

    stage: Stage
    verifier: VerifierRef
    aux_layer_ids: Tuple[int, ...]
    #: what prepare reads: the data's conversations, or the regenerated ones
    source: Source
    #: the data's own conversations (what regenerate reads)
    original: Source
    #: the verifier's regenerated replies (built only with stage regenerate)
    regenerated: ArtifactRef
    prepared: ArtifactRef
    hidden: ArtifactRef
    vocab: ArtifactRef
    hidden_dtype: str
    #: storage_format(extract): aux "native" | "fp8" | "int8", teacher "hidden" | "topk"
    hidden_format: Dict[str, Any]
    #: a number of tokens, or "auto": sized by the vocab stage (`draft_vocab_coverage` of
    #: the trained tokens, at most `draft_vocab_max`)
    draft_vocab_size: Union[int, str]
    draft_vocab_coverage: float
    draft_vocab_max: int
    split: Split
    resume: Resume
    run_dir: Path
    #: the whole resolved config as json (for manifests and the experiment logger)
    config: Dict[str, Any] = field(repr=False, compare=False)
    #: the published draft training starts from (draft.init), None: from scratch
    init: Optional[InitRef] = None

    def describe(self) -> Dict[str, Any]:
        """The plan as json: what `--plan` prints and each run folder's plan.json holds."""
        def ref(a: ArtifactRef) -> Dict[str, Any]:
            return {"folder": str(a.folder), "fingerprint": a.fingerprint,
                    "explicit": a.explicit,
                    "exists": artifacts.complete_manifest(a.folder) is not None}

        return {
            "stage": self.stage.value,
            "verifier": {"path": str(self.verifier.path), "tiny": self.verifier.tiny,
                         "fingerprint": self.verifier.fingerprint,
                         "architectures": list(self.verifier.info.architectures),
                         "family": describe_family(self.verifier.info.architectures,
                                                   self.verifier.info.wrapped),
                         "num_layers": self.verifier.info.num_layers,
                         "hidden_size": self.verifier.info.hidden_size,
                         "vocab_size": self.verifier.info.vocab_size},
            "aux_layer_ids": list(self.aux_layer_ids),
            "data": {**self.source.settings(), "fingerprint": self.source.fingerprint},
            "regenerated": {**ref(self.regenerated), "from": str(self.original.path),
                            "used": self.source is not self.original},
            "split": {"holdout_samples": self.split.holdout,
                      "num_samples": self.split.num_samples,
                      "min_samples": self.split.min_samples},
            "prepared": ref(self.prepared), "hidden": {**ref(self.hidden),
                                                        "dtype": self.hidden_dtype,
                                                        "format": self.hidden_format},
            "vocab": {**ref(self.vocab), "draft_vocab_size": self.draft_vocab_size,
                      **({"coverage": self.draft_vocab_coverage,
                          "max_draft_vocab_size": self.draft_vocab_max}
                         if self.draft_vocab_size == AUTO else {})},
            "resume": self.resume.mode if self.resume.path is None else str(self.resume.path),
            "run_dir": str(self.run_dir),
            **({"init": {"folder": str(self.init.folder), "layout": self.init.layout,
                         "draft_vocab_size": self.init.draft_vocab_size,
                         "vocabulary": "remapped" if self.init.remap else "kept",
                         "fingerprint": self.init.fingerprint}} if self.init else {}),
        }


def read_verifier_info(path: Path, tiny: bool) -> VerifierInfo:
    """config.json facts; for the embedded tiny verifier, its spec until it is built."""
    if tiny and not (path / "config.json").exists():
        from eagle3x.tiny import config_dict

        return VerifierInfo.from_config(config_dict())
    return verifier.read_info(path)


def resolve(cfg: Eagle3xConfig, run_dir: Optional[Path] = None,
            info: Optional[VerifierInfo] = None) -> RunPlan:
    """The plan of a run for the typed, validated config `cfg`.

    `run_dir` is Hydra's job folder (used unless `train.output_dir` is set); `info` skips
    reading config.json again when the caller already has it. Reads config.json and
    fingerprints each input once (memoised per process); builds nothing.
    """
    vpath = Path(cfg.verifier.path).expanduser()
    if info is None:
        info = read_verifier_info(vpath, cfg.verifier.tiny)
    vref = VerifierRef(vpath, cfg.verifier.tiny, cfg.verifier.trust_remote_code,
                       verifier.fingerprint(vpath, tiny=cfg.verifier.tiny), info)
    init = read_init(cfg.draft.init, cfg.vocab.remap) if cfg.draft.init else None
    aux = tuple(verifier.aux_layers(cfg.extract.aux_layer_ids, info.num_layers))
    if init is not None and init.aux_layer_ids is not None:
        if cfg.extract.aux_layer_ids and tuple(cfg.extract.aux_layer_ids) != init.aux_layer_ids:
            raise PlanError("extract.aux_layer_ids",
                            f"{list(cfg.extract.aux_layer_ids)}, but the draft of draft.init "
                            f"was trained on layers {list(init.aux_layer_ids)} (eagle3x's "
                            f"numbering); leave extract.aux_layer_ids unset")
        aux = init.aux_layer_ids

    kwargs = dict(cfg.data.chat_template_kwargs or {})
    original = data_source(cfg)
    data = original.label
    store = _abs(cfg.paths.artifacts)
    regen_fp = None
    if original.fingerprint is not None:
        settings = config_record(cfg.regenerate)
        settings.pop("output_dir")
        settings.pop("batch_size")  # how engine=hf batches; not what it writes
        regen_fp = artifacts.digest({"data": original.fingerprint, "format": original.format,
                                     "verifier": vref.fingerprint, "settings": settings,
                                     "chat_template_kwargs": kwargs,
                                     **({"fields": original.fields} if original.fields else {})})
    if cfg.regenerate.output_dir:
        regenerated = ArtifactRef("regenerated", _abs(cfg.regenerate.output_dir), regen_fp, True)
    else:
        regenerated = ArtifactRef("regenerated", store / "regenerated" / str(regen_fp),
                                  regen_fp, False)
    source = original
    if cfg.data.responses is Responses.regenerated:
        source = Source(regenerated.folder / REGENERATED, "messages", cfg.data.seed,
                        cfg.extract.max_seq_len, regenerated.fingerprint, kwargs,
                        train_reasoning=original.train_reasoning,
                        train_tool_calls=original.train_tool_calls,
                        split_turns=original.split_turns, num_proc=original.num_proc,
                        chunk_size=original.chunk_size)
    prepared_fp = None
    if source.fingerprint is not None:
        prepared_fp = artifacts.digest({"data": source.fingerprint, "verifier": vref.fingerprint,
                                        "prepare_version": PREPARE_VERSION,
                                        **{k: v for k, v in source.settings().items()
                                           if k != "data"}})

    def place(kind: str, explicit: Optional[str], fp: Optional[str], key: str) -> ArtifactRef:
        if explicit:
            return ArtifactRef(kind, _abs(explicit), fp, True)
        if fp is None:
            raise PlanError(key, f"no folder for the {kind} artifact: the prepared data at "
                                 f"{prepared_dir} does not exist and {data} "
                                 f"({'data.name' if original.name else 'data.path'}) cannot "
                                 f"be read to make it; set {key}")
        return ArtifactRef(kind, store / kind / fp, fp, False)

    prepared_dir = cfg.extract.prepared_data or cfg.prepare.output_dir or store / "prepared"
    prepared = place("prepared", cfg.extract.prepared_data or cfg.prepare.output_dir,
                     prepared_fp, "prepare.output_dir")
    # Later artifacts are keyed by the prepared data actually there (an explicit folder may
    # have been made elsewhere), else by what this run will build.
    made = artifacts.complete_manifest(prepared.folder)
    prepared_id = made["fingerprint"] if made else prepared_fp
    hidden_fp = vocab_fp = None
    if prepared_id is not None:
        fmt = storage_format(cfg.extract)
        hidden_fp = artifacts.digest({"prepared": prepared_id, "verifier": vref.fingerprint,
                                      "aux_layer_ids": list(aux), "dtype": cfg.extract.dtype.value,
                                      **({"format": fmt} if fmt != DEFAULT_FORMAT else {})})
        sizing = {"draft_vocab_size": cfg.vocab.draft_vocab_size,
                  **({"coverage": cfg.vocab.coverage,
                      "max_draft_vocab_size": cfg.vocab.max_draft_vocab_size}
                     if cfg.vocab.draft_vocab_size == AUTO else {})}
        if init is not None:  # kept: the draft's own map; re-mapped: from it and the data
            sizing = {"init": init.fingerprint, **(sizing if init.remap else {})}
        vocab_fp = artifacts.digest({"prepared": prepared_id, "num_samples": cfg.data.num_samples,
                                     "holdout_samples": cfg.data.holdout_samples, **sizing})
    hidden = place("hidden", cfg.extract.output_dir, hidden_fp, "extract.output_dir")
    vocab = place("vocab", cfg.vocab.output_dir, vocab_fp, "vocab.output_dir")

    if cfg.train.output_dir:
        out = _abs(cfg.train.output_dir)
    else:
        out = _abs(run_dir) if run_dir is not None else _abs("outputs") / "train"
    return RunPlan(
        stage=cfg.stage, verifier=vref, aux_layer_ids=aux, source=source, original=original,
        regenerated=regenerated, prepared=prepared,
        hidden=hidden, vocab=vocab, hidden_dtype=cfg.extract.dtype.value,
        hidden_format=storage_format(cfg.extract),
        draft_vocab_size=(init.draft_vocab_size if init is not None and not init.remap
                          else cfg.vocab.draft_vocab_size),
        draft_vocab_coverage=cfg.vocab.coverage,
        draft_vocab_max=cfg.vocab.max_draft_vocab_size,
        split=Split(cfg.data.holdout_samples, cfg.data.num_samples, cfg.extract.min_samples),
        resume=Resume.parse(cfg.train.resume), run_dir=out, config=config_record(cfg), init=init)


def input_memo(cfg: Eagle3xConfig) -> Path:
    """Where input files' facts (sha256, records) are remembered between runs."""
    return _abs(cfg.paths.cache) / "inputs"


def data_source(cfg: Eagle3xConfig) -> Source:
    """The data's own conversations (data.*): a file or folder read once for its facts
    (remembered by path, inode, size, mtime and ctime), or a hub dataset's revision."""
    d = cfg.data
    common = dict(seed=d.seed, max_seq_len=cfg.extract.max_seq_len,
                  template_kwargs=dict(d.chat_template_kwargs or {}),
                  fields={k: v for k, v in vars(d.fields).items() if v},
                  train_reasoning=d.train_reasoning, train_tool_calls=d.train_tool_calls,
                  split_turns=d.split_turns, num_proc=num_procs(d.num_proc),
                  chunk_size=d.chunk_size)
    if d.name:
        hub = hub_source(d.name, d.config, d.split)
        fp = None if hub.revision is None else artifacts.digest(
            {"hub": d.name, "config": d.config, "split": d.split, "revision": hub.revision})
        return Source(None, d.format.value, fingerprint=fp, name=d.name, config=d.config,
                      split=d.split, streaming=d.streaming, revision=hub.revision,
                      cached=hub.cached, records=hub.records, **common)
    path = _abs(d.path)
    memo = input_memo(cfg)
    fp = records = None
    if path.is_file():
        facts = artifacts.input_facts(path, memo)
        fp, records = facts.sha256, facts.records
    elif path.exists():
        fp = artifacts.file_fingerprint(path, memo)
    return Source(path, d.format.value, fingerprint=fp, records=records, **common)


def num_procs(value: Optional[int]) -> int:
    """data.num_proc, null meaning the CPUs this process may use, at most 8."""
    if value:
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def config_record(cfg: Any) -> Dict[str, Any]:
    """The whole resolved config as json-able values (enums as their names)."""
    import dataclasses
    from enum import Enum

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)
