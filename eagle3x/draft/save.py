"""Save a trained draft as the folder vLLM's and SGLang's EAGLE-3 loaders read, and load it back.

    draft/config.json        LlamaForCausalLMEagle3 config: sizes, heads, rope, vocabularies,
                             target_hidden_size, the aux layer ids twice (below), the
                             architecture options (num_hidden_layers, norm_before_fc,
                             fc_norm, norm_before_residual, norm_output) under the names
                             vLLM's llama_eagle3.py reads
    draft/model.safetensors  fc, midlayer.*, layers.1.* ... (the later decoder layers, as
                             vLLM's loader numbers them), input_norm / fc_norm.i (with
                             those options), norm, lm_head, d2t, t2d (no embed_tokens unless
                             they were trained: the serving engine shares the verifier's)

The aux layer ids are written where each engine reads them, in its numbering
(`eagle3x.serving`, which cites the engines' sources): top-level
``eagle_aux_hidden_state_layer_ids`` for vLLM (eagle3x's layer k as k + 1) and nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` for SGLang (k, which SGLang shifts itself).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from eagle3x import artifacts
from eagle3x import published, serving
from eagle3x.draft.model import DraftShape, Eagle3Draft

log = logging.getLogger("eagle3x")

WEIGHTS = "model.safetensors"


def draft_config(shape: DraftShape, aux_layer_ids: List[int], dtype: torch.dtype,
                 verifier_architectures: Sequence[str] = ()) -> Dict[str, Any]:
    """config.json of the served folder. A draft SGLang would compute otherwise than
    trained (`serving.vllm_only`) is named so that SGLang refuses to load it rather than serve it
    silently wrong; vLLM loads it under either name."""
    return {
        "architectures": [serving.VLLM_ONLY if serving.vllm_only(shape) else serving.BOTH_ENGINES],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": shape.num_layers,
        "norm_before_fc": shape.norm_before_fc,
        "fc_norm": shape.fc_norm,
        "norm_before_residual": shape.norm_before_residual,
        "norm_output": shape.norm_output,
        # vLLM's LlamaAttention: layer_types[layer - target_layer_count] == "sliding_attention"
        **({"sliding_window": shape.sliding_window,
            "layer_types": ["sliding_attention"] * shape.num_layers}
           if shape.sliding_window else {}),
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.target_vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "eagle_aux_hidden_state_layer_ids": serving.vllm_ids(aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": serving.sglang_ids(aux_layer_ids,
                                                                   verifier_architectures),
            "use_aux_hidden_state": True, "norm_before_fc": shape.norm_before_fc},
        "eagle3x": {"aux_layer_ids": list(aux_layer_ids), "shape": shape.to_dict()},
    }


def served_name(name: str) -> str:
    """The export's name of a draft parameter: the later decoder layers (`more_layers.j`)
    as vLLM's loader numbers its layers (`layers.{j+1}`; `midlayer` is its layers.0)."""
    if name.startswith("more_layers."):
        j, rest = name[len("more_layers."):].split(".", 1)
        return f"layers.{int(j) + 1}.{rest}"
    return name


def trained_name(name: str) -> str:
    """served_name's inverse."""
    if name.startswith("layers."):
        j, rest = name[len("layers."):].split(".", 1)
        return f"more_layers.{int(j) - 1}.{rest}"
    return name


def speculators_config(shape: DraftShape, aux_layer_ids: List[int], dtype: torch.dtype,
                       verifier: str = "", verifier_architectures: Sequence[str] = ()
                       ) -> Dict[str, Any]:
    """config.json in speculators' format (vllm-project/speculators 0.9.0,
    ``speculators/models/eagle3/config.py`` Eagle3SpeculatorConfig, whose pydantic model
    allows extra keys such as ``eagle3x``): the decoder under ``transformer_layer_config``
    (a Llama config: its vocab_size is the verifier's), the options and the aux ids at the
    top, the aux ids in vLLM's numbering (vLLM copies them as they are: ``update_eagle3`` in
    vllm 0.32 ``transformers_utils/configs/speculators/algos.py``), and
    ``speculators_config`` with the fields vLLM's ``validate_speculators_config`` requires
    (a proposal method's speculative_tokens, the verifier's name_or_path)."""
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
             "vocab_size": shape.target_vocab_size, "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size,
             "num_hidden_layers": shape.num_layers,
             "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
             "head_dim": shape.head_dim, "hidden_act": "silu", "rms_norm_eps": shape.rms_norm_eps,
             "rope_theta": shape.rope_theta,
             "max_position_embeddings": shape.max_position_embeddings,
             "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
             "torch_dtype": str(dtype).replace("torch.", ""),
             **({"sliding_window": shape.sliding_window,
                 "layer_types": ["sliding_attention"] * shape.num_layers}
                if shape.sliding_window else {})}
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "norm_before_residual": shape.norm_before_residual,
        "norm_before_fc": shape.norm_before_fc, "fc_norm": shape.fc_norm,
        "norm_output": shape.norm_output, "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": serving.vllm_ids(aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or None,
                         "architectures": list(verifier_architectures)}},
        "torch_dtype": str(dtype).replace("torch.", ""),
        "eagle3x": {"aux_layer_ids": list(aux_layer_ids), "shape": shape.to_dict()},
    }


#: export.format values and what each writes (eagle3x.config.schema.ExportFormat)
FORMATS = ("vllm", "sglang", "speculators")


def stored_name(name: str, fmt: str) -> str:
    """A draft parameter's name in the folder of format `fmt`: speculators numbers the
    first layer layers.0 (``Eagle3DraftModel.layers``), vLLM / SGLang call it midlayer."""
    out = served_name(name)
    if fmt == "speculators" and out.startswith("midlayer."):
        return "layers.0." + out[len("midlayer."):]
    return out


def save(draft: Eagle3Draft, out: str | Path, aux_layer_ids: List[int],
         include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16,
         verifier_architectures: Sequence[str] = (), fmt: str = "vllm",
         verifier: str = "") -> Path:
    """Write config.json + model.safetensors atomically into `out`, in format `fmt`
    (FORMATS): "vllm" and "sglang" write the same folder (named for SGLang unless
    `serving.vllm_only`; "sglang" refuses such a draft), "speculators" speculators' own."""
    from safetensors.torch import save_file

    if fmt == "sglang" and serving.vllm_only(draft.shape):
        raise artifacts.ArtifactError(
            f"export.format=sglang: SGLang does not compute this draft as trained "
            f"({', '.join(serving.vllm_only(draft.shape))})")
    tensors = {}
    for name, t in draft.state_dict().items():
        if name.startswith("embed_tokens.") and not include_embeddings:
            continue
        keep = name in ("d2t", "t2d")
        tensors[stored_name(name, fmt)] = (t.detach().cpu().contiguous() if keep
                                           else t.detach().to(dtype).cpu().contiguous())
    cfg = (speculators_config(draft.shape, aux_layer_ids, dtype, verifier, verifier_architectures)
           if fmt == "speculators"
           else draft_config(draft.shape, aux_layer_ids, dtype, verifier_architectures))
    out = Path(out)
    with artifacts.building(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        with open(tmp / "config.json", "w") as f:
            json.dump(cfg, f, indent=2)
    only = serving.vllm_only(draft.shape)
    if only:
        log.info("the draft at %s is for vLLM (%s): exported as %s, which SGLang does not "
                 "load; draft=sglang trains a draft both engines serve", out, ", ".join(only),
                 serving.VLLM_ONLY)
    return out


def load(folder: str | Path, embeddings: torch.Tensor | None = None) -> Eagle3Draft:
    """Read an exported draft back (safetensors + json only); embeddings from the verifier.
    A folder of another layout (eagle3x.published) is read by `load_published`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    if "eagle3x" not in cfg:  # a draft eagle3x did not write: any layout draft.init reads
        return load_published(published.read(folder), embeddings)
    shape = DraftShape(**cfg["eagle3x"]["shape"])
    state = {published.trained_name(k): v for k, v in load_file(str(folder / WEIGHTS)).items()}
    draft = Eagle3Draft(shape, state["d2t"], state["t2d"])
    if embeddings is not None and "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = embeddings
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in state.items()}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens")]:
        raise artifacts.ArtifactError(f"{folder / WEIGHTS}: unexpected {unexpected}, missing {missing}")
    return draft


def published_state(p: "published.Published") -> Dict[str, torch.Tensor]:
    """Every tensor of a published draft (`eagle3x.published.read`) under eagle3x's names,
    as stored (dtype unchanged); t2d built from d2t where the layout has none."""
    from safetensors import safe_open

    state: Dict[str, torch.Tensor] = {}
    by_file: Dict[Path, List[str]] = {}
    for stored in p.names:
        by_file.setdefault(p.index[stored].file, []).append(stored)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for stored in names:
                state[p.names[stored]] = f.get_tensor(stored)
    if "t2d" not in state:
        d2t, t2d = published.d2t_t2d(p)
        state["t2d"] = torch.from_numpy(t2d)
    return state


def published_weights(p: "published.Published", d2t: torch.Tensor | None = None,
                      t2d: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      new_rows: torch.Tensor | None = None) -> Dict[str, torch.Tensor]:
    """The state dict (float32 weights, exact widening) an Eagle3Draft loads from a
    published draft. With a re-mapped vocabulary (`d2t`, `t2d`, `rows`): lm_head row i is
    the published row `rows[i]`, or `new_rows[i]` where rows[i] < 0."""
    state = published_state(p)
    if d2t is not None:
        head = state["lm_head.weight"].float()
        keep = (rows >= 0)[:, None]
        state["lm_head.weight"] = torch.where(keep, head[rows.clamp(min=0)], new_rows.float())
        state["d2t"], state["t2d"] = d2t.long(), t2d.bool()
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def load_into(draft: Eagle3Draft, state: Dict[str, torch.Tensor], where: str,
              embeddings: bool = True) -> None:
    """Load a published draft's `state` into `draft` (every weight it has; the embedding
    only with `embeddings`); ArtifactError naming what does not fit."""
    if not embeddings:
        state = {k: v for k, v in state.items() if not k.startswith("embed_tokens.")}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise artifacts.ArtifactError(f"{where}: the draft lacks {missing} / has unexpected "
                                      f"{unexpected} for the architecture its config describes")


def load_published(p: "published.Published", embeddings: torch.Tensor | None = None
                   ) -> Eagle3Draft:
    """The published draft as a float32 Eagle3Draft, every stored weight loaded exactly;
    `embeddings` the verifier's, used where the folder carries none."""
    state = published_weights(p)
    draft = Eagle3Draft(DraftShape(**p.shape), state["d2t"], state["t2d"])
    if "embed_tokens.weight" not in state and embeddings is not None:
        state["embed_tokens.weight"] = embeddings.float()
    load_into(draft, state, f"{p.folder} ({p.layout})")
    return draft


def folder_for(run_dir: Path, formats: Sequence[str], fmt: str) -> Path:
    """Where format `fmt` of `formats` is written: the first in <run dir>/draft, each other
    in <run dir>/draft-<format>."""
    return run_dir / ("draft" if fmt == formats[0] else f"draft-{fmt}")


def write_formats(draft: Eagle3Draft, run_dir: Path, formats: Sequence[str],
                  aux_layer_ids: List[int], include_embeddings: bool,
                  verifier_architectures: Sequence[str], verifier: str) -> Path:
    """Write `draft` in every format of `formats` (export.format) under `run_dir`; returns
    the first folder."""
    for fmt in formats:
        out = save(draft, folder_for(run_dir, formats, fmt), aux_layer_ids,
                   include_embeddings=include_embeddings,
                   verifier_architectures=verifier_architectures, fmt=fmt, verifier=verifier)
        log.info("exported the draft as %s -> %s", fmt, out)
    return folder_for(run_dir, formats, formats[0])
