"""What eagle3x needs to know about a verifier, read from its folder without torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from eagle3x.serving import capture_problem

#: Files whose content decides how text becomes token ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model")


@dataclass(frozen=True)
class VerifierInfo:
    """Shape facts from a verifier's config.json."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    architectures: tuple
    raw: dict
    #: the lm_head is the input embedding (no lm_head.weight in the checkpoint)
    tied: bool = False
    #: a multimodal wrapper: the language model's config sits under text_config
    wrapped: bool = False
    #: config.json's quantization_config (a wrapper's at its top level), {} when none
    quantization: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, raw: dict) -> "VerifierInfo":
        text = raw.get("text_config", raw)  # multimodal wrappers keep the LM under text_config
        heads = int(text.get("num_attention_heads", 0))
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            intermediate_size=int(text.get("intermediate_size", 0)),
            architectures=tuple(raw.get("architectures") or ()),
            raw=text,
            # A wrapper's flag sits at its top level (transformers 5 writes it only there).
            tied=bool(raw["tie_word_embeddings"] if "tie_word_embeddings" in raw
                      else text.get("tie_word_embeddings", False)),
            wrapped=text is not raw,
            quantization=dict(raw.get("quantization_config")
                              or text.get("quantization_config") or {}),
        )

    @property
    def logit_softcap(self) -> Optional[float]:
        """Gemma 2/3's final soft-capping: logits -> cap * tanh(logits / cap) after the
        lm_head (transformers' Gemma3ForCausalLM.forward, vLLM's LogitsProcessor)."""
        cap = self.raw.get("final_logit_softcapping")
        return float(cap) if cap else None

    @property
    def logit_scale(self) -> float:
        """What multiplies the lm_head's output: Cohere's `logit_scale`, Granite's
        1 / `logits_scaling` (transformers' CohereForCausalLM / GraniteForCausalLM)."""
        scale = float(self.raw.get("logit_scale") or 1.0)
        return scale / float(self.raw.get("logits_scaling") or 1.0)


def read_info(path: str | Path) -> VerifierInfo:
    """Read config.json of a verifier folder; KeyError/OSError/ValueError on a bad one."""
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return VerifierInfo.from_config(json.load(f))


#: config.json keys vLLM reads for the context length, taking the smallest present
#: (``derive_max_model_len_and_key`` in ``vllm/transformers_utils/
#: model_arch_config_convertor.py``), and the rope types whose `factor` does not extend it
#: (``_get_and_verify_max_len`` in ``vllm/config/model.py``).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")
UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def verifier_context(raw: dict) -> Optional[int]:
    """The longest sequence vLLM will accept for a verifier with this config.json."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    found = [int(text[k]) for k in CONTEXT_KEYS if isinstance(text.get(k), (int, float))]
    if not found:
        return None
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    params = [v for v in rope.values() if isinstance(v, dict)] if all(
        isinstance(v, dict) for v in rope.values()) and rope else [rope]
    factor = 1.0
    for rp in params:
        kind = rp.get("rope_type") or rp.get("type") or "default"
        if kind not in UNSCALED_ROPE and rp.get("factor"):
            factor = float(rp["factor"])
    return int(min(found) * factor)


def default_aux_layers(num_layers: int) -> List[int]:
    """Low / middle / high decoder layers, as EAGLE-3 trainers choose them: [1, N//2-1, N-4],
    moved where they would collide or reach the last layer (whose output the serving
    engines cannot feed the draft), so the three are distinct and servable for every N >= 4:
    N=4 gives [0, 1, 2], N=6 [1, 2, 3]; N >= 8 is unchanged. Fewer layers: what there is."""
    if num_layers < 4:
        return list(range(min(num_layers, 3)))
    low = 1 if num_layers >= 5 else 0
    mid = max(num_layers // 2 - 1, low + 1)
    high = min(max(num_layers - 4, mid + 1), num_layers - 2)
    return [low, mid, high]


def aux_layer_problem(ids: Sequence[int], num_layers: int,
                      architectures: Sequence[str] = ()) -> Optional[str]:
    """Why `ids` cannot be the aux layers of a verifier with `num_layers` layers, or None.

    They must be three distinct layers in increasing order: the HF engine stores them in the
    given order, while vLLM captures (and SGLang and vLLM's drafts concatenate) in ascending
    layer order, so any other order or a repeat trains on features the server never feeds.
    And both serving engines must be able to capture them (`eagle3x.serving`).
    """
    ids = list(ids)
    out = [i for i in ids if not 0 <= i < num_layers]
    if out:
        return (f"layer ids {out} are out of range: the verifier has {num_layers} layers "
                f"(ids 0..{num_layers - 1}).")
    if len(ids) != 3:
        return f"need three layers; the verifier has {num_layers}."
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return ("must be three distinct layers in increasing order: vLLM and SGLang feed the "
                "draft the captured layers in ascending order.")
    return capture_problem(ids, num_layers, architectures)


def aux_layers(cfg_ids: Optional[Sequence[int]], num_layers: int) -> List[int]:
    return list(cfg_ids) if cfg_ids else default_aux_layers(num_layers)


def fingerprint(path: str | Path, tiny: bool = False) -> str:
    """A hash of what makes a verifier's hidden states: config.json and tokenizer files.

    The embedded tiny verifier is identified by its spec, so its fingerprint is known
    before it is first built.
    """
    if tiny:
        from eagle3x.tiny import SPEC_ID

        return hashlib.sha256(SPEC_ID.encode()).hexdigest()
    from eagle3x.artifacts import file_fingerprint

    h = hashlib.sha256()
    root = Path(path)
    for name in ("config.json",) + TOKENIZER_FILES:
        p = root / name
        if p.is_file():  # file_fingerprint: the whole file's sha256 up to 64 MiB
            h.update(name.encode())
            h.update(bytes.fromhex(file_fingerprint(p)))
    return h.hexdigest()


def ensure(path: str | Path, tiny: bool) -> Path:
    """The verifier folder; the embedded tiny verifier is built there first if configured."""
    path = Path(path).expanduser()
    if tiny:
        import logging

        from eagle3x import tiny as tiny_model

        if not (path / "model.safetensors").exists():
            logging.getLogger("eagle3x").info("building the embedded tiny verifier at %s", path)
        tiny_model.build(path)
    return path


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The verifier's tokenizer (transformers; imported here, not at startup)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
