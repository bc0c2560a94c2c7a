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
DIR_ENV = "EAGLE3X_DDP_DIR"
#: Hydra settings a rank must not copy from its job: the rank is one plain job in the job's
#: folder, not a sweep, and has its own log name.
_NOT_FOR_RANKS = ("hydra.run.", "hydra.sweep.", "hydra.mode", "hydra.job.name", "hydra.job.num",
                  "hydra.job.id", "hydra.output_subdir", "hydra/launcher", "hydra/sweeper",
                  "hydra.launcher", "hydra.sweeper")


def share_job(overrides: Sequence[str], hydra_overrides: Sequence[str],
              job_dir: Optional[Path]) -> None:
    """Record this job's overrides (its own and its `hydra.*` ones, which Hydra keeps
    apart) and folder for the rank processes Lightning starts."""
    keep = [o for o in hydra_overrides if not o.lstrip("+~").startswith(_NOT_FOR_RANKS)]
    os.environ[JOB_ENV] = json.dumps({"overrides": list(overrides) + keep})
    if job_dir:
        os.environ[DIR_ENV] = str(job_dir)
    else:
        os.environ.pop(DIR_ENV, None)


def worker_argv() -> Optional[List[str]]:
    """In a rank process Lightning started (LOCAL_RANK >= 1 and a shared job): the command
    line of that one job; else None. The job folder travels in its own variable and is
    read by OmegaConf (no quoting of a path inside an override)."""
    raw, rank = os.environ.get(JOB_ENV), os.environ.get("LOCAL_RANK", "0")
    if not raw or not rank.isdigit() or int(rank) == 0:
        return None
    argv = list(json.loads(raw)["overrides"])
    if os.environ.get(DIR_ENV):
        argv.append("hydra.run.dir=${oc.env:" + DIR_ENV + "}")
    node = os.environ.get("NODE_RANK", "0")
    name = f"rank{rank}" if node == "0" else f"node{node}-rank{rank}"
    return argv + ["hydra.output_subdir=null", f"hydra.job.name={name}"]


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def fit_scope() -> Iterator[None]:
    """Around one `Trainer.fit`: afterwards the process is as before it for the next job of
    a `-m` sweep run in this process. Lightning's launcher leaves LOCAL_RANK & co. in
    os.environ (and `LightningEnvironment.creates_processes_externally` then reads
    LOCAL_RANK as "someone else started the ranks", so the next job would wait for ranks
    nobody starts) and the process group open."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    had_group = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if saved["LOCAL_RANK"] is None:  # this process launched the ranks (or ran alone)
            if dist.is_available() and dist.is_initialized() and not had_group:
                dist.destroy_process_group()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


#: Where a data-parallel extraction worker finds its index when extract.worker is null,
#: in order: SLURM's task rank (srun), then torchrun's global rank.
WORKER_ENV = ("SLURM_PROCID", "RANK")


def extract_worker(workers: int, worker: Optional[int],
                   environ: Optional[dict] = None) -> "tuple[int, str]":
    """(this worker's index, where it came from) for `extract.workers` / `extract.worker`.

    ValueError when it cannot be known or is out of range (preflight reports it)."""
    env = os.environ if environ is None else environ
    if workers <= 1:
        return 0, "single worker"
    if worker is not None:
        source = "extract.worker"
    else:
        name = next((n for n in WORKER_ENV if env.get(n, "").strip()), None)
        if name is None:
            raise ValueError(f"extract.workers={workers} needs this worker's index: set "
                             f"extract.worker (0..{workers - 1}), or run under srun / torchrun "
                             f"({' / '.join(WORKER_ENV)} set)")
        try:
            worker = int(env[name])
        except ValueError:
            raise ValueError(f"environment variable {name}={env[name]!r} is not a worker index")
        source = f"environment variable {name}"
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} (from {source}) is not in 0..{workers - 1} "
                         f"(extract.workers={workers})")
    return worker, source
