"""Multi-process training: how the processes Lightning starts for `trainer.devices=N` find
the job they belong to, and which of them writes.

Lightning's DDP launcher (lightning/fabric/strategies/launchers/subprocess_script.py,
`_SubprocessScriptLauncher._call_children_scripts` and `_hydra_subprocess_cmd`) starts
ranks 1..N-1 by re-running the parent's command line with `hydra.run.dir="<run.dir>"`
appended. Under `-m` that is wrong twice: the command is the whole sweep (each child would
start the sweep again), and `hydra.run.dir` is not the job's folder (`hydra.sweep.dir`/
`subdir` is). So before fitting, the job writes its own single-job command into the
environment the children inherit (`share_job`); a child's `python -m eagle3x` sees it
(`worker_argv`) and runs exactly that job, in that job's folder, logging to
`rank<N>.log`. Every rank trains; only global rank 0 writes checkpoints (Lightning), the
export, summaries and W&B; the others stop after the train stage.

Ranks started by torchrun or SLURM (one process per GPU, Lightning's cluster
environments) run the command they were given; pass them the same `hydra.run.dir` or
`train.output_dir`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

JOB_ENV = "EAGLE3X_DDP_JOB"


def share_job(overrides: Sequence[str], job_dir: Optional[Path]) -> None:
    """Record this job's overrides and folder for the rank processes Lightning starts."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.run.", "hydra.sweep."))]
    os.environ[JOB_ENV] = json.dumps({"overrides": keep,
                                      "dir": str(job_dir) if job_dir else None})


def worker_argv() -> Optional[List[str]]:
    """In a rank process Lightning started (LOCAL_RANK >= 1 and a shared job): the command
    line of that one job; else None."""
    raw, rank = os.environ.get(JOB_ENV), os.environ.get("LOCAL_RANK", "0")
    if not raw or not rank.isdigit() or int(rank) == 0:
        return None
    job = json.loads(raw)
    argv = list(job["overrides"])
    if job["dir"]:
        argv.append(f"hydra.run.dir={json.dumps(job['dir'])}")
    return argv + ["hydra.output_subdir=null", f"hydra.job.name=rank{rank}"]


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def fit_scope() -> Iterator[None]:
    """Around one `Trainer.fit`: afterwards the process is as before it for the next job of
    a `-m` sweep run in this process. Lightning's launcher leaves LOCAL_RANK & co. in
    os.environ (and `LightningEnvironment.creates_processes_externally` then reads
    LOCAL_RANK as "someone else started the ranks", so the next job would wait for ranks
    nobody starts) and the process group open."""
    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    try:
        yield
    finally:
        if saved["LOCAL_RANK"] is None:  # this process launched the ranks (or ran alone)
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
