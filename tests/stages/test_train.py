"""Stage train / eval / export: a real Lightning Trainer, real W&B offline runs, exact resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import Cli, environment, plan_for, stage_output

# Non-default aux layers (the default is [1, 3, 4]), so serving tests see them honoured.
FAST = ["trainer.max_steps=40", "train.ttt_steps=3", "eval.depth=3", "extract.aux_layer_ids=[0,3,5]"]


class TrainedRun:
    """A run trained once for this module, in its own artifact store and folder."""

    def __init__(self, root: Path, cache_dir: Path, *args: str):
        self.root, self.run = root, root / "run"
        self.env = {"EAGLE3X_ARTIFACTS": str(root / "artifacts"), "EAGLE3X_CACHE": str(cache_dir),
                    "WANDB_MODE": "offline"}
        self.result = self.cli(*args, f"train.output_dir={self.run}")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return Cli(self.root)(*args, env=self.env)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """`stage=all` on the tiny default (150 steps), logged to an offline W&B run."""
    return TrainedRun(tmp_path_factory.mktemp("full"), cache_dir, "stage=all", "engine=hf",
                      "logger=wandb")


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory, tiny_verifier, cache_dir) -> TrainedRun:
    """`stage=train` for 40 steps, checkpoints every 4."""
    return TrainedRun(tmp_path_factory.mktemp("fast"), cache_dir, "stage=train", "engine=hf",
                      "logger=none", *FAST)


def untrained_report(overrides: list) -> dict:
    """Eval of the freshly initialised draft, on the same held-out samples."""
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.stages import vocab
    from eagle3x.stages.evaluate import evaluate
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


def test_export_has_the_layout_vllm_reads(fast_run):
    r = fast_run.result
    assert r.returncode == 0, r.stderr[-3000:]
    draft = stage_output(r, "train")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
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


def test_killed_training_resumes_at_the_same_step_with_the_same_data(cli, store, tmp_path):
    common = ["stage=train", "engine=hf", "logger=csv", "trainer.max_steps=40", "train.ttt_steps=3"]
    assert cli("stage=prepare").returncode == 0
    whole = tmp_path / "whole"
    assert cli(*common, f"train.output_dir={whole}").returncode == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "eagle3x", *common, f"train.output_dir={killed}"],
                            cwd=cli.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "checkpoints" / "step000016.ckpt"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not target.exists():
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (killed / "draft").exists()
    state = torch.load(killed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 16 <= state["global_step"] < 40
    r = cli(*common, f"train.output_dir={killed}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    _assert_same_training(whole, killed)


def test_resume_from_an_explicit_checkpoint_path(fast_run, tmp_path):
    run = fast_run.run
    assert fast_run.result.returncode == 0
    ckpt = run / "checkpoints" / "step000020.ckpt"
    other = tmp_path / "other"
    r = fast_run.cli("stage=train", "engine=hf", "logger=none", f"train.output_dir={other}",
                     f"train.resume={ckpt}", *FAST)
    assert r.returncode == 0 and "resuming" not in r.stdout  # explicit path, not auto
    _assert_same_training(run, other)


@pytest.mark.vllm
def test_vllm_serves_the_export_as_an_eagle3_draft_with_identical_greedy_output(full_run,
                                                                                 tiny_verifier):
    pytest.importorskip("vllm")
    run = full_run.run
    assert full_run.result.returncode == 0
    r = subprocess.run([sys.executable, "-m", "eagle3x.draft.vllm_check", "--verifier",
                        str(tiny_verifier), "--draft", str(run / "draft"), "--k", "3"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)  # one json object on stdout, nothing else
    assert report["identical"], report
    assert report["counters"]["drafts"] > 0 and report["counters"]["accepted_tokens"] > 0
    assert report["mean_accepted_length"] > 1.5


@pytest.fixture(scope="module")
def live_eval(fast_run):
    """`stage=eval eval.live=true eval.offline=greedy` on the fast run (aux layers [0, 3, 5]):
    one vLLM engine; the greedy continuations of the offline estimate come from transformers."""
    pytest.importorskip("vllm")
    assert fast_run.result.returncode == 0, fast_run.result.stderr[-3000:]
    r = fast_run.cli("stage=eval", "engine=hf", "eval.live=true", "eval.offline=greedy", "logger=none",
                     "engine.dtype=float32",  # vLLM's "auto" on CPU serves in bfloat16
                     f"train.output_dir={fast_run.run}", *FAST)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((fast_run.run / "eval.json").read_text())


@pytest.mark.vllm
def test_live_eval_records_vllms_counters_and_the_exact_replay_agrees(live_eval, fast_run):
    live = live_eval["live"]
    assert live["prompts"] == 32 and live["speculative_paths_consistent"]
    assert live["verifier_agreement"] > 0.99  # the stored features give vLLM's greedy path
    served, replay = live["served"], live["greedy_offline"]
    assert served["drafts"] > 32 and served["accepted_tokens"] > 0
    assert replay["mean_accepted_length"] == pytest.approx(served["mean_accepted_length"], rel=0.05)
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

    from eagle3x.draft.live import parity
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
    # one screen, apart from progress bars (a bar's refreshes are lines of their own here)
    bars = ("extract:", "prepare:", "regenerate:", "train ")
    lines = [x for x in shown.splitlines() if x.strip() and not x.lstrip().startswith(bars)]
    assert len(lines) < 30, shown


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
