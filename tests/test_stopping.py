"""The stop report's command that continues comes from the job the pipeline read once."""

from __future__ import annotations

from pathlib import Path

from eagle3x.failures import Stopped
from eagle3x.job import Job
from eagle3x.stopping import resume_command, stop_report
from tests.helpers import settings_for

JOB = Job(task=("stage=train", "train.lr=0.001"),
          hydra=("hydra.run.dir=outputs/x", "hydra.job.name=y", "hydra.verbose=true",
                 "hydra/launcher=joblib"),
          dir=Path("/runs/job"), verbose=True, running=True)


def test_a_rerun_repeats_the_hydra_overrides_that_do_not_fix_the_folder_or_launcher():
    assert JOB.rerun_hydra == ("hydra.verbose=true",)


def test_the_command_continues_in_the_job_folder_where_training_ran():
    settings = settings_for(["stage=train"])
    assert resume_command(settings, JOB, ("prepare", "train")) == (
        "python -m eagle3x hydra.verbose=true stage=train train.lr=0.001 "
        "hydra.run.dir=/runs/job")
    # a command without train, eval or export does not pin the folder
    assert resume_command(settings, JOB, ("prepare",)).endswith("train.lr=0.001")
    # an override the cause calls for replaces the job's own
    assert resume_command(settings, JOB, ("train",), ["train.lr=0.01"]).split()[4:] == [
        "stage=train", "train.lr=0.01", "hydra.run.dir=/runs/job"]


def test_no_hydra_job_no_command():
    settings = settings_for(["stage=train"])
    assert resume_command(settings, Job(), ("train",)) is None
    line, code = stop_report(Stopped("stopped by SIGTERM", 143), "prepare", None, settings,
                             Job(), ("prepare",))
    assert code == 143 and "continue with" not in line and line.startswith("prepare")
