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

A rank that fails must not leave the others waiting in their next collective until the
process group times out (30 minutes for gloo, 10 for NCCL). While training, every rank
runs a `RankWatch`: a rank that fails with an error writes why into the run folder
(``<run dir>/.ranks/failed-rank<N>.json``); rank 0 also watches the rank processes it
started (a killed one: its exit status), and those watch rank 0 (their parent). Each
watch looks every `WATCH_INTERVAL` seconds; on a failure elsewhere it reports it (rank 0:
the one console line, through `failures.report`) and ends its process. So every rank stops
within about `WATCH_INTERVAL` of the failure becoming visible (a failing rank's error, or
its process exiting); a rank that hangs without failing is left to the process group's
timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

JOB_ENV = "EAGLE3X_DDP_JOB"
DIR_ENV = "EAGLE3X_DDP_DIR"
def share_job(overrides: Sequence[str], hydra_overrides: Sequence[str],
              job_dir: Optional[Path]) -> None:
    """Record this job's overrides (its own and the `hydra.*` ones a rerun repeats,
    `job.Job.rerun_hydra`: a rank is one plain job in the job's folder, not a sweep, with
    its own log name) and folder for the rank processes Lightning starts."""
    os.environ[JOB_ENV] = json.dumps({"overrides": list(overrides) + list(hydra_overrides)})
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


WATCH_INTERVAL = 1.0
BOARD = ".ranks"
#: (rank, why, world size) of a rank failure this process learnt of, for the report of
#: its own error
_known: List[Tuple[int, str, int]] = []


def known_failure() -> Optional[Tuple[int, str, int]]:
    """(rank, why, world size) of the other rank whose failure this process saw (its own
    error followed), or None."""
    return _known[0] if _known else None


def clear_board(run_dir: Path) -> None:
    """Rank 0, before training: failures recorded by an earlier run of this folder go."""
    folder = run_dir / BOARD
    for f in folder.glob("failed-rank*.json") if folder.exists() else ():
        f.unlink(missing_ok=True)


def _last_error(log_file: Path) -> str:
    """The last error line of a rank's log (its Hydra job log: rank<N>.log)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in text.splitlines() if "Error" in x or "ERROR" in x]
    return lines[-1][-240:] if lines else ""


class RankWatch:
    """One rank's watch over the others while it trains (see the module's docstring)."""

    def __init__(self, run_dir: Path, rank: int, world: int, children: Sequence[Any] = (),
                 interval: float = WATCH_INTERVAL):
        self.board, self.rank, self.world = run_dir / BOARD, rank, world
        self.run_dir = run_dir
        self.children = list(children)  # rank 0: the Popen of each rank it started (1..)
        self.interval = interval
        self.parent = os.getppid() if worker_argv() is not None else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.board.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="eagle3x-rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def failed(self, why: str) -> None:
        """This rank failed: tell the others (then stop watching them), unless the failure
        is the echo of another rank's (a closed connection after it died)."""
        other = self.check(wait=2 * self.interval)  # a dead peer's process is reaped soon
        self._stop.set()
        if other is not None:
            _known.append((*other, self.world))
            return
        from eagle3x import artifacts

        self.board.mkdir(parents=True, exist_ok=True)
        artifacts.write_json_atomic(self.board / f"failed-rank{self.rank}.json",
                                    {"rank": self.rank, "why": why[:500], "pid": os.getpid(),
                                     "time": time.time()})

    def check(self, wait: float = 0.0) -> Optional[Tuple[int, str]]:
        """(rank, why) of another rank known to have failed, or None; `wait` seconds for
        one to show (a killed process takes a moment to be reaped)."""
        deadline = time.monotonic() + wait
        while True:
            found = self._look()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def _look(self) -> Optional[Tuple[int, str]]:
        from eagle3x.failures import exit_code_meaning

        if self.board.exists():
            for f in sorted(self.board.glob("failed-rank*.json")):
                try:
                    rec = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if int(rec.get("rank", -1)) != self.rank:
                    return int(rec["rank"]), str(rec.get("why", "unknown"))
        for i, proc in enumerate(self.children, start=1):
            code = proc.poll()
            if code is not None and code != 0:
                last = _last_error(self.run_dir / f"rank{i}.log")
                return i, exit_code_meaning(code) + (f"; its log: {last}" if last else "")
        if self.parent is not None and os.getppid() != self.parent:
            return 0, "rank 0's process is gone"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            found = self._look()
            if found is not None and not self._stop.is_set():
                self._abort(*found)

    def _abort(self, rank: int, why: str) -> None:
        _known.append((rank, why, self.world))
        from eagle3x.failures import Stopped, report

        code = report(Stopped(f"rank {rank} of {self.world} failed ({why}); every rank "
                              "stopped", 1), stage="train") if self.rank == 0 else 1
        if self.rank != 0:
            logging.getLogger("eagle3x").error(
                "rank %d of %d failed (%s); rank %d stops", rank, self.world, why, self.rank)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(code)
