"""The draft's sizes and the memory training it holds, read from the verifier's config
alone: no torch, so startup (eagle3x.checks.preflight) can size a run before anything
heavy is imported. `draft_shape` is the one source of the draft's dimensions for
training (eagle3x.stages.train) and for startup's memory check."""

from __future__ import annotations

from typing import Any, Dict, Optional

from eagle3x.plan import VerifierRef


def draft_shape(verifier: VerifierRef, draft_vocab: int,
                intermediate_size: Optional[int] = None,
                options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The draft's sizes: the verifier's hidden size, heads and rope; `options` the
    architecture (DraftConfig.options(): layers, norms; default one plain layer)."""
    info = verifier.info
    raw = info.raw
    rope = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return dict(
        hidden_size=info.hidden_size, target_hidden_size=info.hidden_size,
        intermediate_size=intermediate_size or info.intermediate_size,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads,
        head_dim=int(raw.get("head_dim") or info.hidden_size // info.num_heads),
        draft_vocab_size=draft_vocab, target_vocab_size=info.vocab_size,
        rms_norm_eps=verifier.rms_norm_eps, rope_theta=float(rope),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        **(options or {}))


def draft_training_bytes(shape: Dict[str, Any], freeze_embeddings: bool = True,
                         precision: str = "32") -> int:
    """A lower bound of the memory training the draft of `shape` holds, activations left
    out: the weights, and for every trained weight its gradient and AdamW's two moments,
    all in the weights' dtype (`draft.model`, `DraftModule.configure_optimizers`): 16
    bytes a parameter in float32 (also under Lightning's "-mixed" precisions, which keep
    float32 weights), 8 under "bf16-true" / "16-true". The frozen embedding holds its
    weights only. Startup compares it with what an online engine leaves on the device,
    so it never refuses a draft that would fit."""
    width = 2 if str(precision).endswith("-true") and str(precision)[:2] in ("bf", "16") else 4
    h, t, inter = shape["hidden_size"], shape["target_hidden_size"], shape["intermediate_size"]
    q = shape["num_heads"] * shape["head_dim"]
    kv = shape["num_kv_heads"] * shape["head_dim"]
    layers = shape.get("num_layers", 1)
    trained = (3 * t * h  # fc: three aux states in
               + 2 * h * (q + 2 * kv) + q * h  # the first attention reads [embedding, hidden]
               + (layers - 1) * (h * (q + 2 * kv) + q * h)  # later ones the hidden state
               + layers * 3 * h * inter  # MLPs
               + h * shape["draft_vocab_size"]  # lm_head
               + (4 + 3 * (layers - 1)) * h  # norms
               + 3 * t * (bool(shape.get("norm_before_fc")) + bool(shape.get("fc_norm"))))  # aux norms
    embed = shape["target_vocab_size"] * h
    if not freeze_embeddings:
        trained += embed
        embed = 0
    return 4 * width * trained + width * embed
