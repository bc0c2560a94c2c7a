"""What this machine has, read without torch or vLLM: memory as vLLM will see it at start.

vLLM refuses to start when the memory it is told to reserve is not free:
- CPU build: ``vllm/v1/worker/cpu_worker.py`` (``CPUWorker.init_device``) requests
  ``gpu_memory_utilization × total`` of the worker's NUMA node and raises when that exceeds
  the node's available memory, both from ``vllm/utils/cpu_resource_utils.py``
  (``get_memory_node_info``: /sys/devices/system/node/node<N>/meminfo, available = MemFree +
  Active(file) + Inactive(file) + SReclaimable, else psutil's system figures; clamped to
  the cgroup's memory limit).
- GPU build: ``vllm/v1/worker/utils.py`` (``request_memory``) raises when a device's free
  memory at start is below ``gpu_memory_utilization × its total``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional


@dataclass(frozen=True)
class Memory:
    total: int
    available: int
    where: str


def _kib_fields(path: Path, key_at: int) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) > key_at + 1:
            try:
                out[parts[key_at].rstrip(":")] = int(parts[key_at + 1]) * 1024
            except ValueError:
                continue
    return out


def _cgroup_limit() -> Optional[tuple]:
    """(limit, usage) of this process's cgroup v2, when it has a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        usage = int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else (int(limit), usage)


def cpu_memory(node: int = 0) -> Optional[Memory]:
    """Memory of NUMA node `node` as vLLM's CPU worker computes it (None if unreadable)."""
    numa = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        if numa.is_file():
            m = _kib_fields(numa, 2)
            total = m["MemTotal"]
            available = (m["MemFree"] + m.get("Active(file)", 0) + m.get("Inactive(file)", 0)
                         + m.get("SReclaimable", 0))
            where = f"NUMA node {node}"
        else:
            m = _kib_fields(Path("/proc/meminfo"), 0)
            total, available, where = m["MemTotal"], m["MemAvailable"], "this machine"
    except (OSError, KeyError):
        return None
    cg = _cgroup_limit()
    if cg is not None and cg[0] < total:
        total = cg[0]
        available = max(0, min(available, cg[0] - cg[1]))
        where += " (cgroup limit)"
    return Memory(total, available, where)


def gpu_memory() -> List[Memory]:
    """Free and total memory of each visible GPU from nvidia-smi ([] when not readable)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = {}
    for line in out.strip().splitlines():
        try:
            index, total, free = (int(x.strip()) for x in line.split(","))
        except ValueError:
            continue
        rows[index] = Memory(total * 2**20, free * 2**20, f"GPU {index}")
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [rows[i] for i in sorted(rows)]
    picked = [int(d) for d in mask.split(",") if d.strip().isdigit()]
    return [rows[i] for i in picked if i in rows]
