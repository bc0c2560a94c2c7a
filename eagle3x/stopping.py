"""A stage that did not finish, in one line: why, what is kept, the command that continues.

``pipeline.run`` hands here what ended a stage early: ``failures.Stopped`` (a signal, a
failed rank), an engine's death (``engines.errors.EngineFailed``, also as the cause of
another error, e.g. the online hidden states' ``HiddenSourceError``), or any error of a
training rank once another rank is known to have failed. `stop_report` makes the line:

    <stage> stopped: <why>; kept: <what the next run continues from>; continue with:
    python -m eagle3x <this job's overrides>

the cause of an engine's death read from its log (``engines.watch.cause``), what is kept
read from the stage's artifact (samples and shards, regenerated chunks, the last
checkpoint's step), the command this job's own overrides (the `job.Job` the pipeline
read once and hands here), with the run folder where training resumes and any override the cause calls for (a longer engine.rpc_timeout).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from eagle3x.config.schema import Eagle3xConfig
from eagle3x.job import Job
from eagle3x.plan import RunPlan


def _chain(exc: BaseException) -> List[BaseException]:
    out: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in out and len(out) < 10:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def reportable(exc: BaseException) -> bool:
    """A stop `run` reports in one line: `Stopped`, an engine's death anywhere in the
    chain, or any error of a training rank after another rank failed."""
    from eagle3x import distributed
    from eagle3x.engines.errors import EngineFailed
    from eagle3x.failures import Stopped

    return (any(isinstance(e, (Stopped, EngineFailed)) for e in _chain(exc))
            or distributed.known_failure() is not None)


def stop_report(exc: BaseException, stage: Optional[str], plan: Optional[RunPlan],
                settings: Eagle3xConfig, job: Job,
                runs: Sequence[str]) -> Tuple[str, int]:
    """(the console line, the exit status) for a stop: "<stage> stopped: <why>; kept:
    <what>; continue with: python -m eagle3x ...". `job` is the Hydra job the pipeline
    read once (no Hydra job: no command to continue with), `runs` the names of the stages
    the command runs."""
    from eagle3x import distributed
    from eagle3x.engines.errors import EngineFailed
    from eagle3x.failures import Stopped

    chain = _chain(exc)
    stopped = next((e for e in chain if isinstance(e, Stopped)), None)
    engine = next((e for e in chain if isinstance(e, EngineFailed)), None)
    other = distributed.known_failure()
    extra: List[str] = []
    if stopped is not None:
        why, code = stopped.reason, stopped.exit_code
    elif engine is not None:
        cause = engine.cause()
        why = (f"the {engine.engine} engine failed "
               f"{'while starting' if engine.during == 'start' else 'during ' + engine.during}"
               f": {cause}")
        code = 1
        if "RPC timeout" in cause and engine.rpc_timeout:
            extra.append(f"engine.rpc_timeout={4 * int(engine.rpc_timeout)}")
    elif other is not None:
        why, code = f"rank {other[0]} of {other[2]} failed ({other[1]}); every rank stopped", 1
    else:
        why, code = f"{type(exc).__name__}: {exc}", 1
    if stage == "train" and settings.train.resume != "auto":
        extra.append("train.resume=auto")  # the checkpoint this run wrote, not the one it read
    kept = (stopped.kept if stopped is not None and stopped.kept else None)
    if kept is None and plan is not None:
        kept = kept_by(stage, plan, settings)
    parts = [f"{stage or 'the run'} stopped: {why}" if not why.startswith("stopped")
             else f"{stage or 'the run'} {why}"]
    if kept:
        parts.append(f"kept: {kept}")
    command = resume_command(settings, job, runs, extra)
    if command:
        parts.append(f"{'restart' if stage == 'serve' else 'continue'} with: {command}")
    return "; ".join(parts), code


def kept_by(stage: Optional[str], plan: RunPlan, settings: Eagle3xConfig) -> Optional[str]:
    """What a stopped stage leaves that the next run continues from."""
    from eagle3x import artifacts

    try:
        if stage == "extract":
            m = artifacts.read_manifest(plan.hidden.folder)
            parts = sorted((plan.hidden.folder / "parts").glob("*/manifest.json"))
            in_parts = sum(artifacts.read_manifest(x.parent)["samples"] for x in parts)
            return (f"{m['samples']} samples in {len(m['shards'])} shards"
                    + (f" (+{in_parts} in worker parts)" if in_parts else "")
                    + f" in {plan.hidden.folder}")
        if stage == "regenerate":
            from eagle3x.data.regenerate import read_part

            out = plan.regenerated.folder
            m = artifacts.read_manifest(out)
            convs = sum(c["conversations"] for c in m["chunks"])
            under_way = sum(len(read_part(out, int(f.name[6:11])))
                            for f in out.glob("chunk-*.part.jsonl"))
            n, whole = convs + under_way, len(m["chunks"])
            return (f"{n} conversation{'s' * (n != 1)} regenerated ({whole} whole "
                    f"chunk{'s' * (whole != 1)}"
                    f"{f', {under_way} in chunks under way' if under_way else ''}) in {out}")
        if stage == "train":
            return _checkpoint_kept(plan)
        if stage == "eval":
            draft = plan.run_dir / "draft"
            return f"the trained draft in {draft}" if draft.exists() else None
        if stage == "serve":
            return "nothing to keep (a server holds no state)"
    except (artifacts.ArtifactError, OSError, KeyError, ValueError):
        return None
    return None


def _checkpoint_kept(plan: RunPlan) -> str:
    from eagle3x.plan import last_checkpoint

    last = last_checkpoint(plan.run_dir)
    if not last.exists():
        return "no checkpoint yet (training starts again from step 0)"
    try:
        import torch

        step = torch.load(last, map_location="cpu", weights_only=True, mmap=True)["global_step"]
        return f"checkpoint at step {step} ({last})"
    except Exception:
        return f"checkpoint {last}"


def resume_command(settings: Eagle3xConfig, job: Job, runs: Sequence[str],
                   extra: Sequence[str] = ()) -> Optional[str]:
    """`python -m eagle3x <this job's overrides>`: what continues it (None outside a Hydra
    job). A command running train, eval or export in Hydra's job folder gets
    `hydra.run.dir=<that folder>`, where its checkpoints are; `extra` overrides replace
    the job's own of the same keys."""
    import shlex

    if not job.running:
        return None
    keys = {e.split("=", 1)[0] for e in extra}
    args = [o for o in job.task if o.split("=", 1)[0].lstrip("+~") not in keys] + list(extra)
    if not settings.train.output_dir and set(runs) & {"train", "eval", "export"} and job.dir:
        args.append(f"hydra.run.dir={job.dir}")
    return " ".join(["python -m eagle3x", *map(shlex.quote, list(job.rerun_hydra) + args)])
