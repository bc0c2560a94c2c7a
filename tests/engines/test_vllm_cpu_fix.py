"""eagle3x/engines/vllm_cpu_fix.py: the torch rule against the Triton kernel's, the check
that tells a broken function from a working one, and (slow) the plugin in a fresh process
as an engine process loads it, through vLLM's own rejection-sampler code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from eagle3x.engines.vllm_cpu_fix import PLUGIN, broken, expand  # noqa: E402


def kernel_rule(output, input_val, cu_num_tokens, replace_from, replace_to):
    """vllm/v1/sample/rejection_sampler.py `expand_kernel`, one program per request, read
    line by line: start is 0 for request 0, else cu[i-1]; the value, replaced; stored at
    start + offset for offset < end - start."""
    for req in range(cu_num_tokens.shape[0]):
        start = 0 if req == 0 else int(cu_num_tokens[req - 1])
        end = int(cu_num_tokens[req])
        value = input_val[req].item()
        value = replace_to if value == replace_from else value
        for offset in range(end - start):
            output[start + offset] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32])
@pytest.mark.parametrize("seed", range(4))
def test_expand_writes_what_the_triton_kernel_writes(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 9, (1,), generator=g))
    counts = torch.randint(0, 6, (batch,), generator=g)
    cu = torch.cumsum(counts, 0).to(torch.int32)
    if dtype.is_floating_point:
        values = torch.rand(batch, generator=g).to(dtype)
        values[0] = 0.0  # the value replaced (a greedy request's temperature 0 -> 1)
        frm, to = 0, 1
    else:
        values = torch.randint(-5, 5, (batch,), generator=g).to(dtype)
        values[0] = -1
        frm, to = -1, 7
    size = int(cu[-1]) + 3  # the kernel leaves positions past the last request alone
    want = torch.full((size,), -9, dtype=dtype)
    got = want.clone()
    kernel_rule(want, values, cu, frm, to)
    expand(got, values, cu, frm, to, MAX_NUM_TOKENS=8)
    assert torch.equal(got, want)


def test_broken_tells_vllm_cpus_int64_copy_from_a_working_function():
    def int64_copy(output, input_val, cu, frm, to, MAX_NUM_TOKENS=None):  # vllm-cpu 0.32's shape
        expand(output.to(torch.int64), input_val.to(torch.int64), cu, frm, to)

    def raises(*args, **kwargs):
        raise RuntimeError("no such op")

    assert broken(expand) is None
    assert "float32 output" in broken(int64_copy)
    assert "no such op" in broken(raises)


@pytest.mark.slow  # a fresh process importing vLLM
def test_an_engine_process_expands_temperatures_through_the_plugin():
    """What vLLM's worker does at start (worker_base.py: general plugins, then the platform's
    kernel overrides), then the rejection sampler's own `expand_batch_to_tokens` on
    per-request temperatures. Where the installed vLLM needs no mend the plugin must leave
    its function alone; where it does, the temperatures must come out right either way."""
    pytest.importorskip("vllm")
    code = r"""
import json, torch
from vllm.plugins import load_general_plugins, load_plugins_by_group, DEFAULT_PLUGINS_GROUP
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
from eagle3x.engines import vllm_cpu_fix
own = cpu_triton_utils._expand_kernel_impl
own_broken = vllm_cpu_fix.fault() is not None
load_general_plugins()
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
t = expand_batch_to_tokens(torch.tensor([0.6, 0.0, 1.2]), torch.tensor([2, 5, 6], dtype=torch.int32),
                           6, replace_from=0, replace_to=1)
print(json.dumps({"plugins": sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)),
                  "own_broken": own_broken,
                  "replaced": cpu_triton_utils._expand_kernel_impl is not own,
                  "expanded": t.tolist()}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert PLUGIN in got["plugins"]  # the installed package's entry point
    assert got["replaced"] == got["own_broken"]
    assert got["expanded"] == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0, 1.2])
