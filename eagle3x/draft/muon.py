"""Muon whose Newton–Schulz iterations run in a dtype chosen for the device.

torch.optim.Muon orthogonalises each update in bfloat16, always. That is the fast choice on
a GPU, and on CPUs with bfloat16 matrix units (AVX512-BF16, AMX). On a CPU without them
(AVX2: most AMD EPYC before Zen 4, many cloud VMs) bfloat16 matmuls are emulated: a
576 x 1728 Gram matrix took 0.109 s in bfloat16 and 0.013 s in float32 on one AVX2 core
(2026-12-06), and Muon's 5 iterations over a SmolLM2-sized draft layer cost ~24 s a step,
25x the rest of the step. `Muon` here does torch's arithmetic (same momentum, Nesterov,
coefficients, learning-rate adjustment, weight decay, state dict) with the iterations in
`ns_dtype`: "auto" takes bfloat16 on an accelerator and float32 on the CPU.

Contract: with ns_dtype="bfloat16" a step equals torch.optim.Muon's bit for bit; with
"float32" it differs by bfloat16's rounding of the iterations only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def ns_dtype_for(choice: str, device: torch.device) -> torch.dtype:
    """The iterations' dtype: `choice` ("auto", "bfloat16", "float32") on `device`."""
    if choice == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[choice]


def orthogonalise(g: torch.Tensor, coefficients: tuple, steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Newton–Schulz's approximate orthogonalisation of a 2-D `g` (torch's quintic
    iteration: X <- aX + (bA + cA^2)X, A = XX^T), computed in `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted(lr: float, rule: Any, shape: torch.Size) -> float:
    """Muon's learning rate for an A x B matrix (torch's rules): "match_rms_adamw" scales
    by 0.2 sqrt(max(A, B)), "original" or None by sqrt(max(1, A / B))."""
    a, b = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    if rule in (None, "original"):
        return lr * math.sqrt(max(1, a / b))
    return lr


class Muon(torch.optim.Muon):
    """torch.optim.Muon with `ns_dtype` ("auto", "bfloat16", "float32"; module docstring)."""

    def __init__(self, params: Any, ns_dtype: str = "auto", **kwargs: Any):
        if ns_dtype != "auto" and ns_dtype not in DTYPES:
            raise ValueError(f"ns_dtype must be auto, bfloat16 or float32, not {ns_dtype!r}")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list = []
            grads: list = []
            bufs: list = []
            self._init_group(group, params, grads, bufs)
            lr = float(group["lr"])
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - group["momentum"])
                update = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], ns_dtype_for(self.ns_dtype, p.device))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted(lr, group["adjust_lr_fn"], p.shape))
        return loss
