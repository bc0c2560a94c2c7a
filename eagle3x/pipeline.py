"""The stage graph, and running a stage (or all of them) for a validated config.

``STAGES`` is the one table of stages: name, function, the config sections it is handed,
the stages that run before it, whether ``stage=all`` includes it, and its startup checks.
``stage=all``, the stages a stage builds first, preflight and the benchmarks all read it.
One rule for every stage: the stages it depends on run before it in the same command,
each reusing its artifact when present (``before``), so no stage refuses for a missing
input another stage makes.
Adding a stage is one entry here plus its module under ``eagle3x/stages/``.

A run, top to bottom (``run`` below):

    typed settings --verifier.ensure--> tiny verifier built if configured
                   --plan.resolve-----> RunPlan (folders, fingerprints, split, run dir)
                   --each stage-------> Outcome (built / reused / wrote, path)
                   --summary.write----> <run dir>/summary.json
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TYPE_CHECKING, Tuple

from eagle3x.artifacts import Outcome
from eagle3x.checks import preflight
from eagle3x.config.problems import EXIT_REFUSED, Problem, Refused
from eagle3x.config.schema import (EngineName, Eagle3xConfig, HiddenSource, OfflineEval,
                                   Responses, Stage)
from eagle3x.plan import RunPlan, resolve
from eagle3x.stages import evaluate, export, extract, prepare, regenerate, serve, train, vocab

if TYPE_CHECKING:
    from eagle3x.job import Job

log = logging.getLogger("eagle3x")


@dataclass(frozen=True)
class StageSpec:
    name: str
    #: run(plan, **sections) -> Outcome
    run: Callable[..., Outcome]
    #: config sections handed to `run` as keyword arguments of the same names
    sections: Tuple[str, ...] = ()
    #: the stages whose artifacts this one reads, and theirs in turn (the whole closure,
    #: in graph order): run first in the same command, each reusing its artifact when
    #: present, so a stage on a fresh store builds what it needs (a test keeps it closed)
    before: Tuple[str, ...] = ()
    #: part of `stage=all`
    in_all: bool = True
    #: startup checks of the world this stage meets (eagle3x.checks.preflight)
    checks: Tuple[preflight.Check, ...] = ()
    #: a check that needs the stage's heavy library, run before any stage of the command
    #: starts: precheck(plan, settings) -> problems
    precheck: Optional[Callable[[RunPlan, Eagle3xConfig], List[Problem]]] = None
    #: when set, the stage runs as part of another command (`before`, `stage=all`) only
    #: if when(settings) holds; asked for by name it always runs
    when: Optional[Callable[[Eagle3xConfig], bool]] = None
    #: when set, the stage stays out of another command if unless(settings) holds
    unless: Optional[Callable[[Eagle3xConfig], bool]] = None
    #: the RunPlan field of the artifact it writes (None: it always runs: a run folder,
    #: a server)
    artifact: Optional[str] = None
    #: the stages whose artifacts it reads itself (`before` also holds theirs in turn)
    reads: Tuple[str, ...] = ()


def _vllm_support(plan: RunPlan) -> List[Problem]:
    """extract (engine=vllm) and eval.live: vLLM can give this verifier's aux states. The
    families eagle3x knows were decided at startup (preflight.vllm_family); any other
    architecture is asked of vLLM's registry here, before the stages start."""
    from eagle3x.families import family_of

    if family_of(plan.verifier.info.architectures) is not None:
        return []
    from eagle3x.engines.vllm import eagle3_support_problem

    why = eagle3_support_problem(plan.verifier.info.architectures)
    return [Problem("engine", why, value="vllm", hint="engine=hf extracts it (transformers); "
                    "serving needs an architecture vLLM supports EAGLE-3 for")] if why else []


STAGES: Tuple[StageSpec, ...] = (
    StageSpec("regenerate", regenerate.run, sections=("regenerate", "engine"),
              checks=(preflight.chat_template, preflight.gpus, preflight.devices,
                      preflight.engine_memory),
              when=lambda s: s.data.responses is Responses.regenerated,
              artifact="regenerated"),
    StageSpec("prepare", prepare.run, before=("regenerate",), artifact="prepared",
              reads=("regenerate",),
              checks=(preflight.chat_template, preflight.prepared_writable,
                      preflight.context_length)),
    StageSpec("extract", extract.run, sections=("extract", "engine"),
              before=("regenerate", "prepare"), artifact="hidden", reads=("prepare",),
              precheck=lambda p, s: _vllm_support(p) if (
                  s.engine.name is EngineName.vllm and preflight.extraction_pending(p)) else [],
              checks=(preflight.gpus, preflight.devices, preflight.context_length,
                      preflight.prepared_exists, preflight.hidden_writable,
                      preflight.foreign_shards, preflight.extract_workers, preflight.disk,
                      preflight.engine_memory, preflight.vllm_family),
              # hidden=online|server: training gets the hidden states; extract runs only by name
              unless=lambda s: s.hidden.source is not HiddenSource.offline),
    StageSpec("vocab", vocab.run, before=("regenerate", "prepare"), artifact="vocab",
              reads=("prepare",), checks=(preflight.vocab_inputs, preflight.vocab_seen),
              # stage=export draft.init=X converts the published draft: no data needed
              unless=lambda s: s.stage is Stage.export and bool(s.draft.init)),
    StageSpec("train", train.run, sections=("train", "trainer", "logger", "extract", "engine",
                                            "hidden", "draft", "export"),
              before=("regenerate", "prepare", "extract", "vocab"),
              reads=("prepare", "extract", "vocab"), precheck=lambda p, s: [
                  Problem("trainer", why) for why in [train.precheck(s.trainer)] if why],
              checks=(preflight.logger_installed, preflight.wandb_credentials,
                      preflight.trainer_devices, preflight.resume_checkpoint,
                      preflight.train_batches,
                      preflight.online_engine, preflight.vllm_family,
                      preflight.engine_memory, preflight.online_memory,
                      preflight.hidden_servers, preflight.export_formats)),
    StageSpec("eval", evaluate.run, sections=("eval", "train", "extract", "engine", "hidden"),
              checks=(preflight.foreign_shards, preflight.live_serving,
                      preflight.benchmark_sets, preflight.served_depth,
                      preflight.engine_memory,
                      preflight.vllm_family, preflight.hidden_servers),
              precheck=lambda p, s: _vllm_support(p) if (s.eval.live or s.eval.benchmarks or (
                  s.eval.offline is OfflineEval.greedy and s.engine.name is EngineName.vllm))
              else []),
    StageSpec("export", export.run, sections=("train", "trainer", "export", "draft"),
              before=("regenerate", "prepare", "vocab"), reads=("vocab",),
              in_all=False, checks=(preflight.export_formats,)),
    StageSpec("serve", serve.run, sections=("serve", "engine", "extract", "hidden"),
              in_all=False, checks=(preflight.serve_settings, preflight.gpus,
                                    preflight.engine_memory, preflight.vllm_family)),
)
BY_NAME: Dict[str, StageSpec] = {s.name: s for s in STAGES}
#: The stages whose runs write a summary.json into the run folder.
SUMMARISED = (Stage.all, Stage.train, Stage.eval)


def stages_for(stage: Stage, settings: Optional[Eagle3xConfig] = None) -> List[StageSpec]:
    """The stages `python -m eagle3x stage=<stage>` runs, in order (a conditional stage
    joins another command only when its `when(settings)` holds)."""
    def joins(s: StageSpec) -> bool:
        if s.unless is not None and settings is not None and s.unless(settings):
            return False
        return s.when is None or (settings is not None and s.when(settings))

    if stage is Stage.all:
        return [s for s in STAGES if s.in_all and joins(s)]
    spec = BY_NAME[stage.value]
    return [BY_NAME[n] for n in spec.before if joins(BY_NAME[n])] + [spec]


def needed(stage: Stage, stages: Sequence[StageSpec], plan: RunPlan) -> List[StageSpec]:
    """`stages` (a `stages_for` list) less the stages run first that nothing will read: a
    stage run first is kept when a kept stage after it reads it and cannot reuse its own
    artifact (none complete yet; hidden states, which may be extended, and the stages
    without an artifact always read their inputs). So `stage=export` with a finished
    vocabulary reads no prepared data, and prepares none, while `stage=vocab` on a fresh
    store prepares first. The stage asked for always stays; `stage=all` keeps every stage."""
    from eagle3x import artifacts

    if stage is Stage.all or not stages:
        return list(stages)
    wanted = {stages[-1].name}
    for spec in reversed(stages):
        if spec.name not in wanted:
            continue
        ref = getattr(plan, spec.artifact) if spec.artifact else None
        reusable = (ref is not None and spec.name != "extract"
                    and artifacts.complete_manifest(ref.folder) is not None)
        if not reusable:
            wanted |= set(spec.reads)
    return [s for s in stages if s.name in wanted]


def run_stages(plan: RunPlan, settings: Eagle3xConfig, stages: Sequence[StageSpec],
               seconds: Optional[Dict[str, float]] = None,
               started: Optional[List[str]] = None) -> List[Outcome]:
    """Run `stages` in order for `plan`; each gets the plan and its config sections
    (`started` gets each stage's name as it starts). Every stage's precheck runs first:
    problems raise `Refused` before anything starts."""
    problems = [x for spec in stages if spec.precheck for x in spec.precheck(plan, settings)]
    if problems:
        raise Refused(problems)
    outcomes = []
    for spec in stages:
        if started is not None:
            started.append(spec.name)
        t0 = time.perf_counter()
        out = spec.run(plan, **{name: getattr(settings, name) for name in spec.sections})
        took = time.perf_counter() - t0
        if seconds is not None:
            seconds[spec.name] = round(took, 2)
        outcomes.append(out)
        if out.status == "rank":  # a training rank other than 0 stops after training
            break
        log.info("stage %s done in %.1fs -> %s", spec.name, took, out.path)
    return outcomes


def start(settings: Eagle3xConfig, run_dir: Optional[Path] = None) -> RunPlan:
    """Build the embedded tiny verifier if configured, then resolve the run's plan."""
    from eagle3x.verifier import ensure

    ensure(settings.verifier.path, settings.verifier.tiny)
    plan = resolve(settings, run_dir)
    v = plan.verifier.info
    log.info("verifier %s: %s; %d layers, hidden %d, vocabulary %d; aux layers %s",
             plan.verifier.path, plan.describe()["verifier"]["family"], v.num_layers,
             v.hidden_size, v.vocab_size, list(plan.aux_layer_ids))
    return plan


def run(cfg: Any) -> Optional[str]:
    """Hydra's job: run cfg.stage; known errors end the process with one line and status 1.

    A stage that stops early (``failures.Stopped``: a signal, a failed rank) or whose
    engine dies (``engines.errors.EngineFailed``, also as the cause of another error) ends
    with one console line: what stopped and why (read from the engine's log), what is
    kept, the command that continues; the traceback goes to the job's log file."""
    from eagle3x import artifacts, console, distributed, failures
    from eagle3x.artifacts import ArtifactError
    from eagle3x.config.compose import typed
    from eagle3x.data.conversations import DataError
    from eagle3x.data.online import HiddenSourceError

    from eagle3x.job import Job
    from eagle3x.stopping import reportable, stop_report

    settings = typed(cfg)
    job = Job.current()  # read once: the ranks and the stop report get this one
    seconds: Dict[str, float] = {}
    started: List[str] = []
    loud = settings.log.libraries or job.verbose
    _share_job_with_ranks(job)
    plan: Optional[RunPlan] = None
    runs = tuple(s.name for s in stages_for(settings.stage, settings))

    def reporter(exc: BaseException, stage: Optional[str] = None) -> int:
        line, code = stop_report(exc, stage or (started[-1] if started else None), plan,
                                 settings, job, runs)
        log.error("%s", line, exc_info=exc if exc.__traceback__ else None,
                  extra=console.LOG_ONLY)
        out = console.stream() if console.log_file() is not None else sys.stderr
        out.write(f"eagle3x: {line}\n")
        out.flush()
        return code

    failures.set_reporter(reporter)
    try:
        with console.quiet(None if loud else console.job_log_file()):
            try:
                plan = start(settings, job.dir)
                outcomes = run_stages(plan, settings,
                                      needed(settings.stage,
                                             stages_for(settings.stage, settings), plan),
                                      seconds, started)
                if outcomes[-1].status == "rank":
                    return None  # a training rank other than 0: rank 0 writes the rest
                if settings.stage in SUMMARISED:
                    from eagle3x.tracking import summary

                    path = summary.write(plan, outcomes, seconds)
                    artifacts.write_json_atomic(plan.run_dir / "plan.json", plan.describe())
                    log.info("summary -> %s\n%s", path, summary.table(plan, outcomes, seconds))
            except Exception as exc:
                if not reportable(exc):
                    raise
                code = reporter(exc)
                if code >= 128 and distributed.worker_argv() is not None:
                    # a rank Lightning started, stopped with every rank by a signal: rank 0
                    # reports it with this status; a non-zero one here would make
                    # Lightning's child-process observer SIGKILL rank 0
                    # (lightning/fabric/strategies/launchers/subprocess_script.py)
                    code = 0
                sys.exit(code)
            finally:
                _finish_wandb()
        return str(outcomes[-1].path)
    except (DataError, ArtifactError, HiddenSourceError) as exc:
        log.error("%s", exc)
        sys.stderr.write(f"eagle3x: {exc}\n")
        sys.exit(1)
    except Refused as exc:
        sys.stderr.write(str(exc))
        sys.exit(EXIT_REFUSED)
    finally:
        failures.set_reporter(None)


def _share_job_with_ranks(job: "Job") -> None:
    """For `trainer.devices=N`: the processes Lightning starts rerun this job, not the
    command line (eagle3x.distributed); their console shows only errors."""
    from eagle3x import distributed

    if not job.running:
        return
    if distributed.worker_argv() is not None:
        for h in logging.getLogger().handlers:
            if type(h) is logging.StreamHandler:
                h.setLevel(logging.ERROR)
        return
    distributed.share_job(list(job.task), list(job.rerun_hydra), job.dir)


def _finish_wandb() -> None:
    """Close a W&B run the stages opened, so offline runs are whole for `wandb sync`."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None and (getattr(run, "offline", False)
                            or getattr(run.settings, "mode", None) == "offline"):
        folder = Path(run.dir).parent
        log.info("W&B offline run -> %s (upload: wandb sync %s)", folder, folder)
    if run is not None:
        wandb.finish()
