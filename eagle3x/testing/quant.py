"""Make a compressed-tensors W4A16 ("pack-quantized") checkpoint from a float checkpoint
(the zoo's quantized verifiers; eagle3x/testing/zoo.py, build_w4a16).

Torch + safetensors only (no compressed_tensors / llmcompressor import). The output is the
format RedHatAI W4A16 / Kimi-K2.x checkpoints carry:

* config.json gets ``quantization_config`` = {quant_method: compressed-tensors,
  format: pack-quantized, config_groups.group_0.weights: {num_bits 4, type int,
  symmetric true, strategy group, group_size G}, ignore: [...]}
* every quantized ``<name>.weight`` [out, in] is replaced by
  ``<name>.weight_packed``  int32 [out, in/8]   (8 nibbles per int32, packed along the input
                                                 dim, lowest nibble = lowest column; each
                                                 nibble is q + 8, q in [-8, 7])
  ``<name>.weight_scale``   scale_dtype [out, in/G]
  ``<name>.weight_shape``   int64 [2] = (out, in)
  and the dequantized weight is ``q * scale`` (symmetric, no zero point).

Everything else (embeddings, lm_head, norms, biases, routers, and whatever the ignore rules
name) is copied unchanged. Non-weight files (tokenizer, generation_config, ...) are copied.

    quantize(src, dst, group_size=32)              # all Linear weights but lm_head
    quantize(src, dst, 32, only=r"mlp\\.experts\\.\\d+\\.")   # routed experts only
    write_dequantized(src, ref, group_size=32)     # float checkpoint with q*scale weights

`write_dequantized` with the same arguments gives the float reference whose weights are
exactly the dequantized int4 values. Scales are rounded to bfloat16 before q is computed, so
the dequantized value is the same whether the scale is held in bf16 or fp32; they are stored
in the source weights' dtype by default (float32 for the zoo): transformers' compressed-tensors
loader materialises fused MoE experts (DeepseekV3Experts) in the *scale* dtype, so bf16-stored
scales would give bf16 expert weights there; vLLM casts scales to its dtype either way.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

NUM_BITS = 4
PACK = 32 // NUM_BITS  # 8 int4 values per int32
QMIN, QMAX = -(1 << (NUM_BITS - 1)), (1 << (NUM_BITS - 1)) - 1  # -8, 7

#: Names never quantized (as real W4A16 checkpoints ignore them); the 2-D weights kept float.
ALWAYS_KEEP = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|embed)\b|norm|\.gate\.weight$"
                         r"|e_score_correction_bias")


def _quantize_weight(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None = None):
    """w [out, in] float -> (q int8 [out, in] in [-8, 7], scale [out, in/G]).

    The scale is rounded to bfloat16 first (so vLLM's bf16/fp16 copy of it is the same
    number) and stored in scale_dtype (default: w's dtype)."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"input size {in_f} not divisible by group_size {group_size}")
    wg = w.detach().float().reshape(out_f, in_f // group_size, group_size)
    absmax = wg.abs().amax(dim=-1)
    # compressed-tensors' symmetric min-max observer: scale = absmax / ((qmax - qmin) / 2)
    scale = (absmax / ((QMAX - QMIN) / 2)).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale.to(torch.bfloat16).float()  # round first, then quantize against it
    q = torch.round(wg / scale.unsqueeze(-1)).clamp_(QMIN, QMAX).to(torch.int8)
    return q.reshape(out_f, in_f), scale.to(scale_dtype or w.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in [-8, 7] -> int32 [out, in/8] (compressed_tensors.pack_to_int32,
    packed_dim=1)."""
    out_f, in_f = q.shape
    assert in_f % PACK == 0
    u = (q.to(torch.int32) + (1 << (NUM_BITS - 1))).reshape(out_f, in_f // PACK, PACK)
    shifts = torch.arange(PACK, dtype=torch.int32) * NUM_BITS
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, in_f: int) -> torch.Tensor:
    """Inverse of pack_int4 -> int8 [out, in] in [-8, 7]."""
    shifts = torch.arange(PACK, dtype=torch.int32) * NUM_BITS
    u = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :in_f] - (1 << (NUM_BITS - 1))).to(torch.int8)


def _selected(name: str, tensor: torch.Tensor, only: str | None, skip: str | None) -> bool:
    if not name.endswith(".weight") or tensor.ndim != 2 or not tensor.is_floating_point():
        return False
    mod = name[: -len(".weight")]
    if ALWAYS_KEEP.search(name):
        return False
    if only is not None and not re.search(only, mod):
        return False
    if skip is not None and re.search(skip, mod):
        return False
    return True


def _load(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    return tensors


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and \
                p.name not in ("model.safetensors.index.json", "config.json",
                                   "eagle3x_zoo.json"):
            shutil.copy2(p, dst / p.name)


def _ignore_list(tensors, quantized: set[str]) -> list[str]:
    """Explicit names of every Linear-like 2-D weight left in float (what vLLM and
    compressed-tensors match against module names), lm_head first."""
    names = sorted({k[: -len(".weight")] for k, t in tensors.items()
                    if k.endswith(".weight") and t.ndim == 2 and "embed" not in k
                    and "norm" not in k} - quantized)
    return sorted(names, key=lambda n: (n != "lm_head", n))


def quantization_config(group_size: int, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": NUM_BITS, "type": "int", "symmetric": True,
                    "strategy": "group", "group_size": group_size, "dynamic": False,
                    "actorder": None, "observer": "minmax", "observer_kwargs": {},
                    "block_structure": None,
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def _convert(src, dst, group_size, only, skip, scale_dtype, dequantized: bool):
    src, dst = Path(src), Path(dst)
    tensors = _load(src)
    out: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    for name, t in tensors.items():
        if not _selected(name, t, only, skip):
            out[name] = t.contiguous()
            continue
        mod = name[: -len(".weight")]
        q, scale = _quantize_weight(t, group_size, scale_dtype)
        quantized.add(mod)
        if dequantized:
            deq = (q.float().reshape(q.shape[0], -1, group_size)
                   * scale.float().unsqueeze(-1)).reshape(t.shape)
            out[name] = deq.to(t.dtype).contiguous()
        else:
            out[mod + ".weight_packed"] = pack_int4(q).contiguous()
            out[mod + ".weight_scale"] = scale.contiguous()
            out[mod + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
    if not quantized:
        raise ValueError("nothing selected for quantization")
    _copy_side_files(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    if not dequantized:
        cfg["quantization_config"] = quantization_config(group_size,
                                                         _ignore_list(tensors, quantized))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return sorted(quantized)


def quantize(src_folder, dst_folder, group_size: int = 32, only: str | None = None,
             skip: str | None = None, scale_dtype: torch.dtype | None = None):
    """Write a compressed-tensors W4A16 pack-quantized checkpoint of src_folder.

    only / skip: regexes on the module name (e.g. only=r"mlp\\.experts\\.\\d+\\." for
    Kimi-K2.5-like expert-only quantization). Returns the quantized module names."""
    return _convert(src_folder, dst_folder, group_size, only, skip, scale_dtype, False)


def write_dequantized(src_folder, dst_folder, group_size: int = 32, only: str | None = None,
                      skip: str | None = None, scale_dtype: torch.dtype | None = None):
    """Write the float reference: same checkpoint, each quantized weight = q * scale."""
    return _convert(src_folder, dst_folder, group_size, only, skip, scale_dtype, True)
