"""Helpers the tests share: a CLI runner, conversation records, in-process plans."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent.parent


@contextlib.contextmanager
def environment(cwd: Path, env: Optional[Dict[str, str]]) -> Iterator[None]:
    """Run a block in `cwd` with `env` added to os.environ; both restored after."""
    old_cwd, old_env = Path.cwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


class Cli:
    """Runs `python -m eagle3x` as a user would, in the test's folder and environment.

    A command line the validator refuses is answered in-process, by the same functions
    `eagle3x.__main__.main` calls (validate, then format_report, exit status 2), without
    starting Python again; every other command runs in a real subprocess. `real=True`
    always starts the subprocess (for tests of the process itself).
    """

    def __init__(self, cwd: Path, real: bool = False):
        self.cwd, self.real = cwd, real

    def __call__(self, *args: str, env: Optional[Dict[str, str]] = None,
                 timeout: float = 900) -> subprocess.CompletedProcess:
        if not self.real and "--plan" not in args:
            refused = self.refusal(list(args), env)
            if refused is not None:
                return refused
        full_env = dict(os.environ, **(env or {}))
        return subprocess.run([sys.executable, "-m", "eagle3x", *args], cwd=self.cwd,
                              env=full_env, capture_output=True, text=True, timeout=timeout)

    def refusal(self, argv: List[str], env: Optional[Dict[str, str]]) -> Optional[subprocess.CompletedProcess]:
        from eagle3x.__main__ import validate
        from eagle3x.config.problems import EXIT_REFUSED, format_report

        with environment(self.cwd, env):
            try:
                problems = validate(argv)
            except SystemExit:  # argparse's own usage errors: let the real process answer
                return None
        if not problems:
            return None
        return subprocess.CompletedProcess([sys.executable, "-m", "eagle3x", *argv],
                                           EXIT_REFUSED, "", format_report(problems))


def write_jsonl(path: Path, records: List[object]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def messages_record(*turns) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def sharegpt_record(*turns) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in turns]}


def stage_output(result: subprocess.CompletedProcess, stage: str) -> Path:
    """The artifact path a finished stage logged (`stage X done in ... -> PATH`)."""
    for line in (result.stdout + result.stderr).splitlines():
        if f"stage {stage} done in" in line:
            return Path(line.split("-> ", 1)[1].strip())
    raise AssertionError(f"stage {stage} did not finish:\n{result.stdout}\n{result.stderr}")


def settings_for(overrides: Sequence[str]):
    """The typed config (Eagle3xConfig) of `python -m eagle3x <overrides>`, in-process."""
    from eagle3x.config.compose import load_config, typed

    return typed(load_config(list(overrides)))


def plan_for(overrides: Sequence[str], run_dir: Optional[Path] = None):
    """(typed config, resolved plan) for the overrides; the tiny verifier built if configured."""
    from eagle3x.pipeline import start

    settings = settings_for(overrides)
    return settings, start(settings, run_dir)


def prepared_store(root: Path, cache_dir: Path) -> Path:
    """An artifact store under `root` holding the default prepared data, built in-process;
    returns the prepared folder (tests copy the store to protect it)."""
    from eagle3x.data import prepared

    with environment(root, {"EAGLE3X_ARTIFACTS": str(root / "artifacts"),
                            "EAGLE3X_CACHE": str(cache_dir)}):
        _, plan = plan_for(["stage=prepare"])
        outcome = prepared.build(plan)
    assert outcome.status == "built"
    return outcome.path


# Non-default aux layers (the default is [1, 3, 4]), so serving tests see them honoured.
FAST = ["trainer.max_steps=40", "train.ttt_steps=3", "eval.depth=3", "extract.aux_layer_ids=[0,3,5]"]


class TrainedRun:
    """A run trained once for a module (or the session), in its own artifact store and
    folder: `python -m eagle3x *args train.output_dir=<root>/run`."""

    def __init__(self, root: Path, cache_dir: Path, *args: str):
        self.root, self.run = root, root / "run"
        self.env = {"EAGLE3X_ARTIFACTS": str(root / "artifacts"), "EAGLE3X_CACHE": str(cache_dir),
                    "WANDB_MODE": "offline"}
        self.result = self.cli(*args, f"train.output_dir={self.run}")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return Cli(self.root)(*args, env=self.env)
