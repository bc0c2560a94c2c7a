"""Compact hidden-state storage: what a shard keeps of each token, and its bytes.

The storage format of a folder (``plan.storage_format``, in its manifest under "format")
says which tensors a shard holds besides ``input_ids``, ``loss_mask`` and ``offsets``:

aux "native"  aux_hidden [T, 3H] in extract.dtype
aux "fp8"     aux_q [T, 3H] float8_e4m3fn, aux_scale [T, 3] float32: layer j of token t is
              aux_q[t, jH:(j+1)H] * aux_scale[t, j], the scale amax / 448 (e4m3's largest
              finite value), so each token's layer uses the whole fp8 range
aux "int8"    aux_q [T, 3H] int8, aux_scale [T, 3] float32, scale amax / 127, rounded to
              nearest
teacher "hidden"  last_hidden [T, H] in extract.dtype (training applies the verifier's
                  lm_head, restricted to the draft vocabulary)
teacher "topk"    topk_ids [T, K] int32, topk_logp [T, K] float16: the verifier's K most
                  likely next tokens over its full vocabulary, by log-softmax, highest
                  first, so topk_ids[:, 0] is its greedy token

Readers get ``aux_hidden`` (decoded to float32 when quantized) and the teacher tensors as
stored (``decode``). Top-k is taken over the full vocabulary because the draft vocabulary
is chosen after extraction (stage vocab); training keeps the entries inside the draft
vocabulary and renormalises them (``draft/ttt.py``). Torch is imported inside functions.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

#: Largest finite magnitude of each quantized aux format.
QMAX = {"fp8": 448.0, "int8": 127.0}
#: Bytes of one token's input id and loss-mask entry.
ID_MASK_BYTES = 4 + 1


def bytes_per_token(hidden_size: int, dtype_bytes: int, fmt: Mapping[str, Any]) -> int:
    """Bytes one token takes in a shard of format `fmt` (offsets and headers aside)."""
    aux = 3 * hidden_size * dtype_bytes if fmt["aux"] == "native" else 3 * hidden_size + 3 * 4
    teacher = hidden_size * dtype_bytes if fmt["teacher"] == "hidden" else fmt["topk"] * (4 + 2)
    return aux + teacher + ID_MASK_BYTES


def baseline_bytes_per_token(hidden_size: int) -> int:
    """The format every peer stores: bf16 aux (3H) and last hidden state (H), 8H bytes."""
    return bytes_per_token(hidden_size, 2, {"aux": "native", "teacher": "hidden"})


def quantize(x: Any, kind: str, layers: int = 3) -> Dict[str, Any]:
    """`x` [T, layers*H] as `kind` ("fp8" | "int8") with one scale per token and layer."""
    import torch

    t = x.shape[0]
    v = x.float().reshape(t, layers, -1)
    scale = v.abs().amax(-1).clamp(min=1e-12) / QMAX[kind]  # [T, layers]
    y = v / scale[..., None]
    if kind == "fp8":
        q = y.to(torch.float8_e4m3fn)
    else:
        q = y.round().clamp(-127, 127).to(torch.int8)
    return {"aux_q": q.reshape(t, -1), "aux_scale": scale}


def dequantize(q: Any, scale: Any) -> Any:
    """float32 [T, layers*H] from `aux_q` and `aux_scale`."""
    t, layers = scale.shape
    return (q.float().reshape(t, layers, -1) * scale.float()[..., None]).reshape(t, -1)


def topk_teacher(last: Any, head: Any, k: int, chunk: int = 256, softcap: Any = None,
                 scale: float = 1.0) -> Dict[str, Any]:
    """The verifier's top-`k` next tokens and log-probs over its full vocabulary, from its
    last hidden states `last` [T, H] and lm_head `head` [V, H] (on `head`'s device,
    `chunk` positions at a time: a [chunk, V] float32 block, 256 MiB for a 262K
    vocabulary; `softcap`, `scale`: what the family applies after the lm_head,
    ``weights.verifier_logits``)."""
    import torch

    from eagle3x.weights import verifier_logits

    ids, logp = [], []
    for a in range(0, last.shape[0], chunk):
        logits = verifier_logits(last[a:a + chunk].to(head.device), head, softcap, scale)
        lp = torch.log_softmax(logits, -1)
        v, i = lp.topk(min(k, lp.shape[-1]), dim=-1)
        ids.append(i.to(torch.int32).cpu())
        logp.append(v.to(torch.float16).cpu())
    return {"topk_ids": torch.cat(ids), "topk_logp": torch.cat(logp)}


def encode(aux: Any, last: Any, fmt: Mapping[str, Any], dtype: Any,
           head: Any = None, softcap: Any = None, scale: float = 1.0) -> Dict[str, Any]:
    """One sample's stored tensors (all [T, ...]) in format `fmt`; `dtype` is extract.dtype's
    torch dtype; `head` the verifier's lm_head, `softcap` and `scale` what follows it (for
    teacher "topk")."""
    out = ({"aux_hidden": aux.to(dtype)} if fmt["aux"] == "native"
           else quantize(aux, fmt["aux"]))
    if fmt["teacher"] == "hidden":
        out["last_hidden"] = last.to(dtype)
    else:
        out.update(topk_teacher(last, head, fmt["topk"], softcap=softcap, scale=scale))
    return out


def keys(fmt: Mapping[str, Any]) -> tuple:
    """The per-token tensors a shard of format `fmt` holds besides ids and mask."""
    aux = ("aux_hidden",) if fmt["aux"] == "native" else ("aux_q", "aux_scale")
    teacher = ("last_hidden",) if fmt["teacher"] == "hidden" else ("topk_ids", "topk_logp")
    return aux + teacher


def decode(stored: Mapping[str, Any]) -> Dict[str, Any]:
    """What training reads from one sample's stored tensors: `aux_hidden` and the teacher
    (`last_hidden`, or `topk_ids` + `topk_logp`)."""
    out = {k: v for k, v in stored.items() if k not in ("aux_q", "aux_scale")}
    if "aux_q" in stored:
        out["aux_hidden"] = dequantize(stored["aux_q"], stored["aux_scale"])
    return out
