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
from eagle3x import serving
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


def save(draft: Eagle3Draft, out: str | Path, aux_layer_ids: List[int],
         include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16,
         verifier_architectures: Sequence[str] = ()) -> Path:
    """Write config.json + model.safetensors atomically into `out`."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in draft.state_dict().items():
        if name.startswith("embed_tokens.") and not include_embeddings:
            continue
        keep = name in ("d2t", "t2d")
        tensors[served_name(name)] = (t.detach().cpu().contiguous() if keep
                                      else t.detach().to(dtype).cpu().contiguous())
    out = Path(out)
    with artifacts.building(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        with open(tmp / "config.json", "w") as f:
            json.dump(draft_config(draft.shape, aux_layer_ids, dtype, verifier_architectures), f,
                      indent=2)
    only = serving.vllm_only(draft.shape)
    if only:
        log.info("the draft at %s is for vLLM (%s): exported as %s, which SGLang does not "
                 "load; draft=sglang trains a draft both engines serve", out, ", ".join(only),
                 serving.VLLM_ONLY)
    return out


def load(folder: str | Path, embeddings: torch.Tensor | None = None) -> Eagle3Draft:
    """Read an exported draft back (safetensors + json only); embeddings from the verifier."""
    from safetensors.torch import load_file

    folder = Path(folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    shape = DraftShape(**cfg["eagle3x"]["shape"])
    state = {trained_name(k): v for k, v in load_file(str(folder / WEIGHTS)).items()}
    draft = Eagle3Draft(shape, state["d2t"], state["t2d"])
    if embeddings is not None and "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = embeddings
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in state.items()}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens")]:
        raise artifacts.ArtifactError(f"{folder / WEIGHTS}: unexpected {unexpected}, missing {missing}")
    return draft
