"""`python -m eagle3x stage=<stage> [overrides]`: validate everything, then run the stage.

The whole command line (every job of a `-m` sweep) is composed and checked before
Hydra starts a job, and before torch, vLLM, Lightning or transformers is imported:
overrides against the schema (compose), each value against its field's rule (rules),
then the world each stage of the run will meet (preflight, per the stage graph).
A refused run prints one report and exits with status 2.
`python -m eagle3x --plan stage=... [overrides]` prints the resolved plan as json instead,
with the stages the command runs and which of them build their artifact (`stages`).
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from eagle3x.config.problems import EXIT_REFUSED, Problem, format_report


def validate(argv: Sequence[str], notes: Optional[List[str]] = None) -> List[Problem]:
    """Every problem with this command line, across all jobs it would start; what a valid
    run should still be told before it starts is appended to `notes`."""
    from hydra._internal.utils import get_args_parser

    from eagle3x.config.compose import compose_checked, expand_jobs, typed
    from eagle3x.checks.preflight import notices, preflight
    from eagle3x.config.rules import check_values
    from eagle3x.pipeline import stages_for

    args = get_args_parser().parse_args(list(argv))
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return []
    inspect_only = args.cfg is not None
    jobs, problems = expand_jobs(args.overrides, args.multirun)
    seen = {p.render() for p in problems}
    for job in jobs:
        cfg, found = compose_checked(job)
        if cfg is not None:
            found += check_values(cfg, need_stage=not inspect_only)
            if not found and not inspect_only:
                settings = typed(cfg)
                stages = stages_for(settings.stage, settings)
                checks = list(dict.fromkeys(c for s in stages for c in s.checks))
                found += preflight(settings, [s.name for s in stages], checks, job)
                if notes is not None:
                    notes += [n for n in notices(settings, [s.name for s in stages])
                              if n not in notes]
        for p in found:
            if len(jobs) > 1 and p.where != "command line":
                p.where = "sweep job: " + " ".join(job)
            if p.render() not in seen:
                seen.add(p.render())
                problems.append(p)
    return problems


def show_plans(argv: Sequence[str]) -> str:
    """The resolved plan of each job of a valid command line, as json (nothing is built)."""
    import json

    from hydra._internal.utils import get_args_parser

    from eagle3x.config.compose import compose_checked, expand_jobs, typed
    from eagle3x.plan import resolve

    args = get_args_parser().parse_args(list(argv))
    jobs, _ = expand_jobs(args.overrides, args.multirun)
    extra = shared_extraction(argv)
    plans = []
    for job in jobs:
        settings = typed(compose_checked([*job, *extra])[0])
        resolved = resolve(settings)
        plan = resolved.describe()
        plan["stages"] = stage_plan(resolved, settings)
        if not settings.train.output_dir:
            plan["run_dir"] = "the Hydra job folder (hydra.run.dir / hydra.sweep.dir)"
        plans.append(plan)
    return json.dumps(plans[0] if len(plans) == 1 else plans, indent=2) + "\n"


def stage_plan(plan, settings) -> List[dict]:
    """The stages the command runs, in order (`pipeline.needed`), each with what it does:
    "builds" its artifact (none complete there yet), "reuses" it (hidden states holding
    too few samples are extended), or "runs" (train, eval, export, serve: no artifact of
    the store)."""
    from eagle3x import artifacts
    from eagle3x.pipeline import needed, stages_for

    out = []
    for spec in needed(settings.stage, stages_for(settings.stage, settings), plan):
        ref = getattr(plan, spec.artifact) if spec.artifact else None
        if ref is None:
            out.append({"stage": spec.name, "does": "runs"})
            continue
        done = artifacts.complete_manifest(ref.folder) is not None
        out.append({"stage": spec.name, "does": "reuses" if done else "builds",
                    "folder": str(ref.folder)})
    return out


def shared_extraction(argv: Sequence[str]) -> List[str]:
    """For a `-m` sweep over data.num_samples: the override that lets the first job extract
    the largest count, so the other jobs reuse those hidden states (empty otherwise)."""
    from hydra._internal.utils import get_args_parser

    from eagle3x.config.compose import expand_jobs

    args = get_args_parser().parse_args(list(argv))
    if not args.multirun or any(o.startswith("extract.min_samples=") for o in args.overrides):
        return []
    jobs, _ = expand_jobs(args.overrides, True)
    counts = {o.split("=", 1)[1] for job in jobs for o in job if o.startswith("data.num_samples=")}
    if len(counts) < 2 or not all(c.isdigit() for c in counts):
        return []
    return [f"extract.min_samples={max(map(int, counts))}"]


def _run_hydra() -> None:
    import hydra
    from omegaconf import DictConfig

    from eagle3x.config.compose import conf_dir, setup

    setup()

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def _job(cfg: DictConfig) -> Optional[str]:
        from eagle3x.pipeline import run

        return run(cfg)

    _job()


def main(argv: Optional[Sequence[str]] = None) -> None:
    from eagle3x.distributed import worker_argv

    argv = sys.argv[1:] if argv is None else list(argv)
    job = worker_argv()
    if job is not None:  # a training rank Lightning started: its job, already validated
        sys.argv = [sys.argv[0], *job]
        _run_hydra()
        return
    wants_plan = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    notes: List[str] = []
    problems = validate(argv, notes)
    if problems:
        sys.stderr.write(format_report(problems))
        sys.exit(EXIT_REFUSED)
    for note in notes:
        sys.stderr.write(f"eagle3x: note: {note}\n")
    if wants_plan:
        sys.stdout.write(show_plans(argv))
        return
    sys.argv = [sys.argv[0], *argv, *shared_extraction(argv)]
    _run_hydra()


if __name__ == "__main__":
    main()
