"""This Hydra job, read once: what the pipeline and its stop report know of the command.

`Job.current()` reads Hydra's config of the running job (no Hydra job: `Job()`, the
empty job): its own overrides (`task`), its `hydra.*` overrides, its folder and whether
Hydra runs verbose. `pipeline.run` reads it once at the start and hands it on (the rank
processes Lightning starts, the stop report's command that continues); nothing else asks
Hydra. `rerun_hydra` is the `hydra.*` overrides a new process of the same job repeats:
not those fixing the run folder, the sweep, the job's name and number or the launcher
(those are the job's own: a rank reruns in the same folder, given apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

#: `hydra.*` overrides a rerun of the job leaves out (prefixes, after any +/~).
NOT_RERUN = ("hydra.run.", "hydra.sweep.", "hydra.mode", "hydra.job.name", "hydra.job.num",
             "hydra.job.id", "hydra.output_subdir", "hydra/launcher", "hydra/sweeper",
             "hydra.launcher", "hydra.sweeper")


@dataclass(frozen=True)
class Job:
    #: the job's own overrides, as given
    task: Tuple[str, ...] = ()
    #: its `hydra.*` overrides, as given
    hydra: Tuple[str, ...] = ()
    #: Hydra's output folder of the job (None: no Hydra job)
    dir: Optional[Path] = None
    #: `hydra.verbose` set
    verbose: bool = False
    #: a Hydra job is running (else every field is empty)
    running: bool = False

    @property
    def rerun_hydra(self) -> Tuple[str, ...]:
        """The `hydra.*` overrides a new process of this job repeats."""
        return tuple(o for o in self.hydra if not o.lstrip("+~").startswith(NOT_RERUN))

    @staticmethod
    def current() -> "Job":
        """The running Hydra job, or `Job()` where none runs (a library call, a test)."""
        try:
            from hydra.core.hydra_config import HydraConfig

            if not HydraConfig.initialized():
                return Job()
            hc = HydraConfig.get()
        except ValueError:  # HydraConfig not set in this process
            return Job()
        out = hc.runtime.output_dir
        return Job(task=tuple(hc.overrides.task), hydra=tuple(hc.overrides.hydra),
                   dir=Path(out) if out else None, verbose=bool(hc.verbose), running=True)
