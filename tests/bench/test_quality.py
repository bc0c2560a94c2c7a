"""bench/quality.py's command line and report: the data sets and time budget it passes to
eagle3x (checked against eagle3x's own config), and the equal-time summary's arithmetic."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
quality = pytest.importorskip("quality")  # bench/quality.py (imports nothing heavy)


def test_every_data_form_selects_its_own_set(tmp_path):
    convs = tmp_path / "code.jsonl"
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]}) + "\n")
    args = quality.parse(["--verifier", "tiny", "--data", "original,regenerated",
                          "--data", f"code={convs}@regenerated", "--data", "hub=hf:org/chats",
                          "--holdout", "7"])
    assert args.data == ["original", "regenerated", "code", "hub"]
    assert args.data_overrides["original"] == ["data.responses=original"]
    assert args.data_overrides["code"] == ["data=jsonl", f"data.path={convs.resolve()}",
                                           "data.responses=regenerated", "data.holdout_samples=7"]
    assert args.data_overrides["hub"][:2] == ["data=hf", "data.name=org/chats"]
    assert "data.responses=original" in args.data_overrides["hub"]
    assert args.steps == 200 and args.budget_seconds is None


@pytest.mark.parametrize("bad", ["nope", "x=/does/not/exist.jsonl", "=a.jsonl", "a b=x"])
def test_a_data_entry_it_cannot_read_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        quality.parse(["--verifier", "tiny", "--data", bad])
    assert "--data" in capsys.readouterr().err


@pytest.mark.parametrize("maker", ["code_prompts", "chat_prompts"])
def test_a_prompt_set_of_placeholders_is_refused_without_regenerated(maker, tmp_path, capsys):
    """bench/code_prompts.py and chat_prompts.py write placeholder replies (a stub, a
    marker): trained as written, a draft learns them. Refused unless @regenerated, naming
    the script; a file with one real reply among them is taken as written."""
    import importlib

    rows = importlib.import_module(maker).build(10, 0)
    convs = tmp_path / "set.jsonl"
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        quality.parse(["--verifier", "tiny", "--data", f"mine={convs}"])
    err = capsys.readouterr().err
    assert f"bench/{maker}.py" in err and f"mine={convs}@regenerated" in err
    ok = quality.parse(["--verifier", "tiny", "--data", f"mine={convs}@regenerated"])
    assert "data.responses=regenerated" in ok.data_overrides["mine"]
    rows[3]["messages"][1]["content"] = "A real reply."
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "data.responses=original" in quality.parse(
        ["--verifier", "tiny", "--data", f"mine={convs}"]).data_overrides["mine"]


def test_a_time_budget_reaches_eagle3x_as_max_time_and_its_config_takes_it(tmp_path):
    """The overrides the bench runs compose under eagle3x's own config (no key unknown to
    it), with the budget as trainer.max_time and the step count as a far cap."""
    from eagle3x.config.compose import load_config, typed

    convs = tmp_path / "c.jsonl"
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}) + "\n")
    args = quality.parse(["--verifier", "tiny", "--budget-seconds", "150",
                          "--data", f"mine={convs}", "--store", str(tmp_path / "store")])
    assert args.steps == 100000
    over = quality.base_overrides(args, "mine")
    settings = typed(load_config(["stage=train", *over]))
    assert settings.trainer.max_time == 150.0
    assert settings.trainer.max_steps == 100000
    assert settings.data.path == str(convs.resolve()) and settings.data.holdout_samples == 32
    plain = quality.parse(["--verifier", "tiny", "--store", str(tmp_path / "store")])
    assert typed(load_config(["stage=train", *quality.base_overrides(plain, "regenerated")])
                 ).trainer.max_time is None


def test_a_variant_replaces_a_key_the_bench_sets_for_every_recipe(tmp_path):
    """`--variant b2:train.batch_size=2` once reached eagle3x beside the bench's own
    train.batch_size=4 and was refused as a key given twice: the variant's value wins."""
    from eagle3x.config.compose import load_config, typed

    args = quality.parse(["--verifier", "tiny", "--store", str(tmp_path / "store"),
                          "--variant", "b2:train.batch_size=2,train.lr=0.01"])
    over = quality.with_variant(quality.base_overrides(args, "regenerated"),
                                dict(args.recipes)["b2"])
    assert [o for o in over if o.startswith("train.batch_size=")] == ["train.batch_size=2"]
    settings = typed(load_config(["stage=train", *over]))
    assert settings.train.batch_size == 2 and settings.train.lr == 0.01
    assert quality.with_variant(["a=1", "b=2"], []) == ["a=1", "b=2"]


def test_eagle3x_refuses_a_time_budget_that_is_not_positive(cli):
    r = cli("stage=train", "trainer.max_time=0")
    assert r.returncode == 2 and "trainer.max_time" in r.stderr


def record(data, recipe, seed, length, seconds, steps=10):
    return {"data": data, "recipe": recipe, "seed": seed,
            "train": {"train_seconds": seconds, "steps": steps},
            "depths": {3: {"vllm": length}}}


def test_the_summary_gives_each_recipe_its_seed_mean_spread_and_place_beside_the_peer():
    runs = [record("code", "eagle3x", 0, 2.0, 100), record("code", "eagle3x", 1, 2.2, 110),
            record("code", "peer", 0, 1.6, 100), record("code", "peer", 1, 1.8, 90),
            record("chat", "eagle3x", 0, 1.5, 100), record("chat", "eagle3x", 1, 1.9, 100),
            record("chat", "peer", 0, 1.6, 100), record("chat", "peer", 1, 1.7, 100)]
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
            for line in quality.summary_of(runs)[2:]}
    code = [c.strip() for c in rows[("code", "eagle3x")].strip("|").split("|")]
    mean, peer = statistics.mean([2.0, 2.2]), statistics.mean([1.6, 1.8])
    assert code[4] == f"{mean:.3f} (2.000..2.200)"
    assert code[5] == f"{statistics.stdev([2.0, 2.2]):.3f}"
    assert code[6] == "105" and code[8] == f"{(mean - 1) / 105 * 1000:.2f}"
    assert code[9] == f"{mean / peer:.3f}x" and code[10] == "ahead"
    chat = [c.strip() for c in rows[("chat", "eagle3x")].strip("|").split("|")]
    assert chat[10] == "within the spread"  # 1.5..1.9 against 1.6..1.7


def test_the_verdict_needs_seeds_on_both_sides():
    assert quality.verdict([2.0], [1.0, 1.1]) == "one seed"
    assert quality.verdict([1.0, 1.05], [1.1, 1.2]) == "behind"
    assert quality.verdict([1.3, 1.4], [1.1, 1.2]) == "ahead"
    assert quality.verdict([1.15, 1.4], [1.1, 1.2]) == "within the spread"


def test_acceptance_per_training_second_is_what_each_second_bought():
    assert quality.per_ks(2.0, 500) == pytest.approx(2.0)
    assert quality.per_ks(None, 500) is None and quality.per_ks(2.0, None) is None
    line = quality.rows_of([record("code", "peer", 0, 1.5, 250)])[2]
    assert "| **1.500** | 2.00 |" in line


def test_eagle3x_train_seconds_leave_its_validation_out():
    assert quality.fit_seconds({"train_seconds": 119.0,
                                "throughput": {"validation_seconds": 25.5}}) == 93.5
    assert quality.fit_seconds({"train_seconds": 80.0}) == 80.0
    assert quality.fit_seconds({}) is None


def test_a_reused_draft_is_served_again_only_where_its_eval_is_older_than_it(tmp_path, monkeypatch):
    """A rerun reads eval-k{k}.json of a reused draft when it is newer than the draft, and
    serves again (the eval command runs) where it is missing or older."""
    import os

    folder = tmp_path / "run"
    (folder / "draft").mkdir(parents=True)
    (folder / "draft" / "config.json").write_text("{}")
    os.utime(folder / "draft" / "config.json", (1000, 1000))
    (folder / "eval-k3.json").write_text(json.dumps({"live": {"served": {"mean_accepted_length": 1.8}}}))
    served = []

    def run(argv, log, args):  # the eval command: it writes eval.json as stage=eval does
        served.append(next(a for a in argv if a.startswith("eval.depth=")))
        (folder / "eval.json").write_text(json.dumps({"live": {"served": {"mean_accepted_length": 1.2}}}))
        return 0, 1.0

    monkeypatch.setattr(quality, "eagle3x", run)
    args = quality.parse(["--data", "original", "--depths", "3,5"])
    args.verifier_path = str(tmp_path / "verifier")
    rec = quality.eagle3x_eval(args, {"data": "original", "recipe": "eagle3x", "seed": 0,
                                      "overrides": [], "folder": str(folder), "reused": True})
    assert served == ["eval.depth=5"]
    assert rec["depths"][3]["vllm"] == 1.8 and rec["depths"][5]["vllm"] == 1.2
    assert json.loads((folder / "eval-k5.json").read_text())["live"]["served"][
        "mean_accepted_length"] == 1.2  # kept for the next rerun
    os.utime(folder / "eval-k3.json", (10, 10))  # older than the draft: served again
    rec = quality.eagle3x_eval(args, {"data": "original", "recipe": "eagle3x", "seed": 0,
                                      "overrides": [], "folder": str(folder), "reused": True})
    assert served[1:] == ["eval.depth=3"] and rec["depths"][3]["vllm"] == 1.2
