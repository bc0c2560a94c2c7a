"""What a training step of the draft costs: FLOPs per token from the shape and the TTT steps,
and the share of the device's peak a run achieved. No torch at import (the arithmetic is
plain; `device_peak` imports torch only to read the device).

Counted (multiply-add = 2 FLOPs), per position of a batch (every real token, what the
loop's tokens/s counts), for `steps` TTT steps and `layers` decoder layers:

    fc         2 * (3 Ht) * H                          once (step 0 reads the aux states)
    attention  per step and layer: q, k, v and o projections, 2 * d_in * (q + 2 kv) + 2 q H
               (d_in = 2H for the first layer, which reads [embedding, hidden]; H after),
               and scores + values over `context` step-0 keys and the k same-position keys
               of the earlier steps: 4 * heads * head_dim * (context + k)
    mlp        per step and layer: 2 * 3 * H * intermediate
    lm_head    per step, on the trained positions only (`head_fraction` of them):
               2 * H * draft_vocab
    teacher    the verifier's head over the draft vocabulary, once per position, no grad:
               2 * Ht * draft_vocab (the loss's target; the greedy token over the full
               vocabulary for acc_k is computed on logging steps only and left out)

Training = forward + backward, backward ~ 2x forward for a matmul whose weight and input
both take gradients: fc 2x (its input, the verifier's features, takes none), lm_head 3x
trained / 2x frozen (eagle3x forms its gradients inside the forward: dz @ W, and dz^T @ x
only when trained), the teacher 1x, everything else 3x. Left out: norms, rope, softmax,
the element-wise loss, the embedding lookup (no matmul), and recomputation (the MLP past
train.checkpoint_mlp_tokens, long attention blocks): MFU counts the model's FLOPs, not the
implementation's.

`context`: step-0 keys a query attends on average. Causal attention over samples of
lengths L_i (each its own document): sum L_i (L_i + 1) / 2 / sum L_i, at most the
sliding window (`causal_context`). The dense reference path scores every key and masks
(context = the row length); the fused kernels skip what the mask removes.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple


def causal_context(lengths: Iterable[int], window: Optional[int] = None) -> float:
    """Mean step-0 keys per query of causal attention within samples of these lengths
    (each query at position t sees t + 1 keys, at most `window`)."""
    keys = positions = 0
    for n in lengths:
        n = int(n)
        if window is None or n <= window:
            keys += n * (n + 1) // 2
        else:
            keys += window * (window + 1) // 2 + (n - window) * window
        positions += n
    return keys / positions if positions else 0.0


def flops_per_token(shape: Dict[str, Any], steps: int, context: float,
                    head_fraction: float = 1.0, lm_head_trained: bool = True,
                    same_position_keys: bool = True) -> Dict[str, float]:
    """Forward FLOPs per position of each part (fc, attention_proj, attention_scores, mlp,
    lm_head, teacher), and `train`: the forward + backward total (module docstring).
    `shape`: draft_shape()'s dict (hidden_size, target_hidden_size, intermediate_size,
    num_heads, num_kv_heads, head_dim, draft_vocab_size, num_layers, num_aux).
    `same_position_keys=False` leaves out the k same-position keys of step k (an
    element-wise product in eagle3x's reference path, not a matmul)."""
    h, ht = shape["hidden_size"], shape["target_hidden_size"]
    q = shape["num_heads"] * shape["head_dim"]
    kv = shape["num_kv_heads"] * shape["head_dim"]
    layers = int(shape.get("num_layers", 1))
    vd = shape["draft_vocab_size"]
    proj = (2 * 2 * h * (q + 2 * kv) + 2 * q * h) + (layers - 1) * (2 * h * (q + 2 * kv) + 2 * q * h)
    keys = sum(context + (k if same_position_keys else 0) for k in range(steps))
    fwd = {
        "fc": 2.0 * shape.get("num_aux", 3) * ht * h,
        "attention_proj": float(steps * proj),
        "attention_scores": 4.0 * q * layers * keys,
        "mlp": 6.0 * h * shape["intermediate_size"] * layers * steps,
        "lm_head": 2.0 * h * vd * steps * head_fraction,
        "teacher": 2.0 * ht * vd,
    }
    factor = {"fc": 2, "attention_proj": 3, "attention_scores": 3, "mlp": 3,
              "lm_head": 3 if lm_head_trained else 2, "teacher": 1}
    fwd["train"] = sum(factor[k] * v for k, v in fwd.items())
    return fwd


#: Dense bfloat16 / float16 tensor-core peaks (FLOP/s, no sparsity) of known GPUs, from
#: the vendors' data sheets, by a substring of torch.cuda.get_device_name(); first match.
GPU_PEAKS: Tuple[Tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
    ("H20", 148e12), ("GH200", 989e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A10", 125e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A6000", 155e12),
    ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("V100", 125e12), ("T4", 65e12),
    ("MI300X", 1307e12), ("MI250", 362e12),
)


def gpu_peak(name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name (GPU_PEAKS), or None when unknown."""
    for key, peak in GPU_PEAKS:
        if key.lower() in name.lower():
            return peak
    return None


def measured_matmul_rate(size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of float32 [size x size] matrix products on this process's CPU threads, best
    of repeated products for about `seconds`: what a CPU run's share is taken of (a CPU's
    peak is not tabled: cores, vector units and clocks vary, and a shared machine gives
    what it gives)."""
    import time

    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size ** 3 / max(time.perf_counter() - t0, 1e-9))
    return best


def device_peak(device: Any) -> Tuple[Optional[float], str]:
    """(peak FLOP/s, what it is) for a torch device: a GPU's tabled dense bf16 peak, a
    CPU's measured float32 matmul rate; (None, why) for an unknown GPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name)
        if peak is None:
            return None, f"{name}: peak unknown (not in eagle3x.draft.cost.GPU_PEAKS)"
        return peak, f"{name} dense bf16 peak"
    rate = measured_matmul_rate()
    return rate, f"this CPU's measured float32 matmul rate ({torch.get_num_threads()} threads)"


def cost_line(cost: Dict[str, Any]) -> str:
    """"cost: 1.23 GFLOP/token (fwd+bwd, 7 TTT steps), 850 tok/s, 1.05 TFLOP/s = 3.1% of
    <peak>" from train_summary.json's `cost`."""
    text = (f"cost: {cost['flops_per_token'] / 1e9:.3g} GFLOP/token (forward + backward, "
            f"{cost['ttt_steps']} TTT steps)")
    if cost.get("tokens_per_second"):
        text += (f", {cost['tokens_per_second']:.0f} tok/s, "
                 f"{cost['achieved_flops'] / 1e12:.3g} TFLOP/s")
        if cost.get("peak_flops"):
            text += f" = {100 * cost['fraction_of_peak']:.2g}% of {cost['peak']}"
        else:
            text += f" ({cost.get('peak')})"
    return text
