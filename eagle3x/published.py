"""A published EAGLE-3 draft, read from its folder without torch (``draft.init``).

Contract: ``read(folder)`` returns a `Published` (the layout's name, the DraftShape fields,
the aux layer ids in eagle3x's numbering or None, each stored tensor's eagle3x name) or
raises `LayoutError` naming what it found. Only config.json and safetensors headers are
read (``tensor_index``); the weights themselves are loaded by ``eagle3x.draft.save.load_published``.

The layouts, each from the source of the project that writes or loads it:

``eagle3x``
    eagle3x's own export (``eagle3x.draft.save``): config.json carries ``eagle3x.shape`` and
    ``eagle3x.aux_layer_ids``.
``llama-eagle3`` (EAGLE's, SGLang's, SpecForge's ``LlamaForCausalLMEagle3``; vLLM's
``Eagle3LlamaForCausalLM``)
    a Llama config.json (sizes, ``draft_vocab_size``, ``target_hidden_size``) and the tensors
    ``fc``, ``midlayer.*`` (vLLM also accepts ``layers.0.*``: its ``hf_to_vllm_mapper``
    renames midlayer to layers.0, vllm 0.32 ``model_executor/models/llama_eagle3.py``),
    ``layers.{j}.*`` for later layers, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and
    optionally ``embed_tokens``, ``input_norm``, ``fc_norm.{i}``. The options are the keys
    vLLM reads there (``norm_before_fc`` in ``eagle_config`` or at the top, ``fc_norm``,
    ``norm_before_residual``, ``norm_output``, all false when absent; a sliding window as
    ``sliding_window`` + ``layer_types``). Aux ids: the top-level
    ``eagle_aux_hidden_state_layer_ids`` is vLLM's numbering (eagle3x's k + 1); the nested
    ``eagle_config`` one SGLang's (k) (``eagle3x.serving`` cites both engines).
``speculators`` (vllm-project/speculators 0.9.0)
    ``speculators_model_type: eagle3``; the decoder's sizes under
    ``transformer_layer_config`` (its ``vocab_size`` is the verifier's), the options at the
    top (``Eagle3SpeculatorConfig`` in ``speculators/models/eagle3/config.py``: every
    option false when absent, ``norm_before_residual`` too), tensors ``layers.{j}.*`` (the
    first is layers.0: ``Eagle3DraftModel.__init__`` in ``speculators/models/eagle3/core.py``),
    ``verifier_*`` never saved. Aux ids at the top in vLLM's numbering (vLLM copies them
    unchanged: ``update_eagle3`` in vllm 0.32 ``transformers_utils/configs/speculators/algos.py``).
``modelopt`` (NVIDIA TensorRT-Model-Optimizer, ``modelopt/torch/export/plugins/hf_spec_export.py``)
    ``architectures: [LlamaForCausalLM]`` with an ``eagle_config`` of
    ``use_input_layernorm_in_first_layer`` / ``use_last_layernorm`` / ``use_mtp_layernorm``
    and aux ids (the output of layer k, as ModelOpt's default [1, N/2-1, N-4] shows: the
    numbering assumed, not verified by running ModelOpt); tensors ``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``, ``d2t``, no ``t2d`` (built from d2t here).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

WEIGHTS_INDEX = "model.safetensors.index.json"
#: tensors a layout may carry that a draft never loads
IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")
LAYER_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")


class LayoutError(ValueError):
    """The folder is not a draft eagle3x can read; the message names what it found."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: Tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class Published:
    folder: Path
    layout: str
    #: DraftShape fields (eagle3x.draft.model.DraftShape)
    shape: Dict[str, Any]
    #: eagle3x's numbering (the output of decoder layer k); None: the folder names none
    aux_layer_ids: Optional[Tuple[int, ...]]
    #: stored tensor name -> eagle3x's trained name (eagle3x.draft.model.Eagle3Draft)
    names: Dict[str, str]
    index: Dict[str, TensorEntry] = field(repr=False, default_factory=dict)
    #: speculators_config.verifier.name_or_path, when the folder names its verifier
    verifier_name: Optional[str] = None

    @property
    def has_embeddings(self) -> bool:
        return "embed_tokens.weight" in self.names.values()


def hub_folder(name: str) -> Optional[Path]:
    """The newest cached snapshot of hub model `name` (HF_HUB_CACHE, else $HF_HOME/hub),
    from the cache only: refs/main, else the most recently written snapshot."""
    if os.environ.get("HF_HUB_CACHE"):
        cache = Path(os.environ["HF_HUB_CACHE"]).expanduser()
    else:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = Path(home).expanduser() / "hub"
    root = cache / ("models--" + name.replace("/", "--"))
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted((root / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) \
        if (root / "snapshots").is_dir() else []
    return snaps[-1] if snaps else None


def locate(init: str) -> Path:
    """`init` as a folder: a path, else a hub id found in the huggingface_hub cache.
    LayoutError when neither."""
    p = Path(init).expanduser()
    if p.is_dir():
        return p.resolve()
    if "/" in init and not init.startswith(("/", ".", "~")) and init.count("/") == 1:
        snap = hub_folder(init)
        if snap is not None:
            return snap
        raise LayoutError(f"{init!r} is no folder, and the hub id is not in the huggingface_hub "
                          f"cache (offline): `huggingface-cli download {init}` fetches it")
    raise LayoutError(f"{init}: no such folder")


def _header(path: Path) -> Dict[str, TensorEntry]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    base = 8 + n
    return {k: TensorEntry(path, v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0],
                           base + v["data_offsets"][1])
            for k, v in head.items() if k != "__metadata__"}


def tensor_index(folder: Path) -> Dict[str, TensorEntry]:
    """Every tensor of the folder's safetensors (through the index when sharded), by name,
    from the files' headers alone."""
    folder = Path(folder)
    idx = folder / WEIGHTS_INDEX
    if idx.is_file():
        with open(idx, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    out: Dict[str, TensorEntry] = {}
    for name in files:
        out.update(_header(folder / name))
    return out


def read_array(entry: TensorEntry, rows: Optional[Sequence[int]] = None) -> Any:
    """A stored tensor (or some of its rows) as a float32 / int64 / bool numpy array; bf16
    widened exactly."""
    import numpy as np

    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
             "I32": np.int32, "BOOL": np.bool_, "U8": np.uint8, "F64": np.float64}
    if entry.dtype not in kinds:
        raise LayoutError(f"{entry.file}: dtype {entry.dtype} is not readable here")
    dt = np.dtype(kinds[entry.dtype])
    width = int(np.prod(entry.shape[1:])) if len(entry.shape) > 1 else 1
    with open(entry.file, "rb") as f:
        if rows is None:
            f.seek(entry.start)
            a = np.frombuffer(f.read(entry.end - entry.start), dtype=dt).reshape(entry.shape)
        else:
            parts = []
            for r in rows:
                f.seek(entry.start + int(r) * width * dt.itemsize)
                parts.append(np.frombuffer(f.read(width * dt.itemsize), dtype=dt))
            a = np.stack(parts).reshape((len(parts),) + tuple(entry.shape[1:]))
    if entry.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32) if a.dtype.kind == "f" else a


def bf16_bits(a: Any) -> Any:
    """float32 values rounded to bfloat16 (round to nearest even), as uint16 bit patterns:
    the common precision a draft's copy of the verifier's embedding is compared in."""
    import numpy as np

    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def trained_name(stored: str) -> Optional[str]:
    """The eagle3x name of a stored tensor in any layout, or None for an unknown name.
    ``model.`` prefixes are dropped; the first decoder layer is midlayer (or layers.0);
    later layers layers.{j} are eagle3x's more_layers.{j-1}."""
    name = stored[len("model."):] if stored.startswith("model.") else stored
    if name.startswith("midlayer."):
        return name if _layer_part(name[len("midlayer."):], first=True) else None
    if name.startswith("layers."):
        j, _, rest = name[len("layers."):].partition(".")
        if not j.isdigit() or not _layer_part(rest, first=j == "0"):
            return None
        return f"midlayer.{rest}" if j == "0" else f"more_layers.{int(j) - 1}.{rest}"
    if name in ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight",
                "input_norm.weight", "d2t", "t2d"):
        return name
    if name.startswith("fc_norm.") and name.endswith(".weight") and name.split(".")[1].isdigit():
        return name
    return None


def _layer_part(rest: str, first: bool) -> bool:
    return rest in LAYER_PARTS or (first and rest == "hidden_norm.weight")


def _ids(raw: Any, shift: int) -> Optional[Tuple[int, ...]]:
    if not raw:
        return None
    return tuple(int(k) + shift for k in raw)


def _common(cfg: Dict[str, Any], index: Dict[str, TensorEntry], num_layers: int) -> Dict[str, Any]:
    """The DraftShape sizes from a Llama-style config and the stored tensors' shapes."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    fc = _entry(index, "fc.weight")
    if fc is None:
        raise LayoutError("no fc.weight")
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if fc.shape[1] % target_hidden:
        raise LayoutError(f"fc.weight is {list(fc.shape)}: its input width is no multiple of "
                          f"target_hidden_size {target_hidden}")
    lm = _entry(index, "lm_head.weight")
    draft_vocab = int(cfg.get("draft_vocab_size") or (lm.shape[0] if lm else cfg["vocab_size"]))
    rope = (cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
            or 10000.0)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise LayoutError(f"rope scaling {kind!r} ({scaling}): eagle3x's draft computes "
                          f"unscaled rotary embeddings, so it would not train what the "
                          f"engines serve from this config")
    types = cfg.get("layer_types") or []
    window = cfg.get("sliding_window") if "sliding_attention" in types else None
    return dict(hidden_size=hidden, target_hidden_size=target_hidden,
                intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                draft_vocab_size=draft_vocab, target_vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                num_aux=fc.shape[1] // target_hidden, num_layers=num_layers,
                sliding_window=int(window) if window else None)


def _entry(index: Dict[str, TensorEntry], name: str) -> Optional[TensorEntry]:
    return index.get(name) or index.get("model." + name)


def _layers(names: Dict[str, str]) -> int:
    more = {int(n.split(".")[1]) for n in names.values() if n.startswith("more_layers.")}
    return 1 + (max(more) + 1 if more else 0)


def read(folder: str | Path) -> Published:
    """The published draft in `folder` (see the module's docstring for the layouts)."""
    folder = Path(folder)
    try:
        with open(folder / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{folder}: no readable config.json ({exc})") from None
    index = tensor_index(folder)
    if not index:
        found = sorted(p.name for p in folder.iterdir())[:12]
        raise LayoutError(f"{folder}: no safetensors weights (found {found}; a .bin "
                          f"checkpoint must be converted to safetensors first)")
    names: Dict[str, str] = {}
    unknown = []
    for k in index:
        if k in IGNORED:
            continue
        t = trained_name(k)
        (unknown.append(k) if t is None else names.__setitem__(k, t))
    if unknown or "midlayer.self_attn.q_proj.weight" not in names.values():
        keys = ", ".join(sorted(index)[:10]) + (" ..." if len(index) > 10 else "")
        raise LayoutError(f"{folder}: not an EAGLE-3 Llama draft eagle3x reads "
                          f"({'unknown tensors ' + ', '.join(unknown[:6]) + '; ' if unknown else ''}"
                          f"tensors found: {keys}; config keys: {', '.join(sorted(cfg)[:12])})")
    archs = list(cfg.get("architectures") or [])
    eagle = cfg.get("eagle_config") or {}
    try:
        if isinstance(cfg.get("eagle3x"), dict):
            shape = dict(cfg["eagle3x"]["shape"])
            aux = tuple(cfg["eagle3x"]["aux_layer_ids"])
            layout = "eagle3x (speculators)" if "speculators_model_type" in cfg else "eagle3x"
        elif cfg.get("speculators_model_type") is not None:
            if cfg["speculators_model_type"] != "eagle3":
                raise LayoutError(f"speculators_model_type is {cfg['speculators_model_type']!r}: "
                                  f"only eagle3 drafts are read")
            tl = dict(cfg.get("transformer_layer_config") or {})
            tl.setdefault("target_hidden_size", cfg.get("target_hidden_size"))
            tl["draft_vocab_size"] = cfg.get("draft_vocab_size", 32000)
            shape = _common(tl, index, _layers(names))
            shape.update({k: bool(cfg.get(k, False)) for k in
                          ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")})
            aux = _ids(cfg.get("eagle_aux_hidden_state_layer_ids"), -1)
            layout = "speculators"
        elif archs == ["LlamaForCausalLM"] and "use_last_layernorm" in eagle:
            for key, want in (("use_input_layernorm_in_first_layer", True),
                              ("use_last_layernorm", True), ("use_mtp_layernorm", False)):
                if eagle.get(key) is not None and bool(eagle[key]) != want:
                    raise LayoutError(f"eagle_config.{key}={eagle[key]}: a ModelOpt draft "
                                      f"variant no serving engine's EAGLE-3 Llama draft computes")
            shape = _common(cfg, index, _layers(names))
            shape.update(norm_before_fc=False, fc_norm=False, norm_before_residual=False,
                         norm_output=False)
            aux = _ids(eagle.get("eagle_aux_hidden_state_layer_ids"), 0)
            layout = "modelopt"
        elif any(a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM") for a in archs):
            shape = _common(cfg, index, _layers(names))
            shape.update(norm_before_fc=bool(eagle.get("norm_before_fc",
                                                       cfg.get("norm_before_fc", False))),
                         fc_norm=bool(cfg.get("fc_norm", False)),
                         norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                         norm_output=bool(cfg.get("norm_output", False)))
            aux = (_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), -1)
                   or _ids(eagle.get("eagle_aux_hidden_state_layer_ids"), 0))
            layout = "llama-eagle3"
        else:
            raise LayoutError(f"architectures {archs} with config keys "
                              f"{', '.join(sorted(cfg)[:12])}: none of the layouts read "
                              f"(LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, speculators' "
                              f"eagle3, ModelOpt's LlamaForCausalLM + eagle_config)")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, LayoutError):
            raise LayoutError(f"{folder}: {exc}") from None
        raise LayoutError(f"{folder}: config.json lacks or mistypes {exc}") from None
    if "d2t" not in names.values():
        raise LayoutError(f"{folder}: no d2t (the draft's vocabulary map) among its tensors")
    _check_tensors(folder, shape, names, index)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return Published(folder=folder, layout=layout, shape=shape,
                     aux_layer_ids=aux, names=names, index=index, verifier_name=verifier)


def _check_tensors(folder: Path, s: Dict[str, Any], names: Dict[str, str],
                   index: Dict[str, TensorEntry]) -> None:
    """The stored shapes are those of the architecture the config describes."""
    by = {t: index[k].shape for k, t in names.items()}
    want = {"fc.weight": (s["hidden_size"], s["num_aux"] * s["target_hidden_size"]),
            "lm_head.weight": (s["draft_vocab_size"], s["hidden_size"]),
            "d2t": (s["draft_vocab_size"],),
            "midlayer.self_attn.q_proj.weight": (s["num_heads"] * s["head_dim"], 2 * s["hidden_size"]),
            "midlayer.mlp.down_proj.weight": (s["hidden_size"], s["intermediate_size"])}
    if "t2d" in by:
        want["t2d"] = (s["target_vocab_size"],)
    bad = [f"{k} {list(by[k])} (the config says {list(v)})" for k, v in want.items()
           if k in by and tuple(by[k]) != v]
    if "lm_head.weight" not in by:
        bad.append("no lm_head.weight")
    if s.get("norm_before_fc") and "input_norm.weight" not in by:
        bad.append("norm_before_fc is set but there is no input_norm.weight")
    if bad:
        raise LayoutError(f"{folder}: tensors disagree with its config.json: " + "; ".join(bad))


def d2t_t2d(p: Published) -> Tuple[Any, Any]:
    """The draft's vocabulary map as numpy (d2t int64 [draft], t2d bool [target]); t2d built
    from d2t when the layout stores none (ModelOpt)."""
    import numpy as np

    inv = {t: k for k, t in p.names.items()}
    d2t = read_array(p.index[inv["d2t"]]).astype(np.int64)
    if "t2d" in inv:
        t2d = read_array(p.index[inv["t2d"]]).astype(bool)
    else:
        t2d = np.zeros(p.shape["target_vocab_size"], dtype=bool)
        t2d[np.arange(len(d2t)) + d2t] = True
    return d2t, t2d


def map_problem(d2t: Any, t2d: Any, target_vocab: int) -> Optional[str]:
    """Why d2t/t2d are not one consistent map into a vocabulary of `target_vocab`, or None."""
    import numpy as np

    targets = np.arange(len(d2t)) + d2t
    if len(targets) and (targets.min() < 0 or targets.max() >= target_vocab):
        return f"d2t maps draft ids to target ids outside 0..{target_vocab - 1}"
    if len(np.unique(targets)) != len(targets):
        return "d2t maps two draft ids to one target id"
    if len(t2d) != target_vocab or not np.array_equal(np.flatnonzero(t2d), np.sort(targets)):
        return "t2d does not mark exactly the target ids d2t maps to"
    return None


def embedding_mismatch(p: Published, verifier_entry: TensorEntry, samples: int = 16) -> Optional[str]:
    """Whether the embedding rows the draft carries are the verifier's, compared at
    bfloat16 precision on `samples` evenly spaced rows; None when they are (or the draft
    carries none), else the rows that differ."""
    import numpy as np

    inv = {t: k for k, t in p.names.items()}
    if "embed_tokens.weight" not in inv:
        return None
    mine = p.index[inv["embed_tokens.weight"]]
    if tuple(mine.shape) != tuple(verifier_entry.shape):
        return (f"its embed_tokens is {list(mine.shape)}, the verifier's "
                f"{list(verifier_entry.shape)}")
    rows = np.unique(np.linspace(0, mine.shape[0] - 1, samples).astype(int))
    a, b = bf16_bits(read_array(mine, rows)), bf16_bits(read_array(verifier_entry, rows))
    differ = [int(r) for r, x, y in zip(rows, a, b) if not np.array_equal(x, y)]
    if differ:
        return (f"its embed_tokens rows {differ[:5]} differ from the verifier's (compared at "
                f"bfloat16 on {len(rows)} rows): it was made for another verifier")
    return None


def ids_problem(aux: Sequence[int], num_layers: int) -> Optional[str]:
    out = [k for k in aux if not 0 <= k < num_layers]
    return (f"its aux layer ids (eagle3x's numbering: the output of layer k) {list(aux)} "
            f"include {out}, outside the verifier's layers 0..{num_layers - 1}") if out else None


def as_list(x: Optional[Sequence[int]]) -> Optional[List[int]]:
    return list(x) if x is not None else None
