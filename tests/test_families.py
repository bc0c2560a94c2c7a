"""The family table (eagle3x.families) is what startup decides from: every row's vLLM claim
holds against the installed vLLM's registry, the docs' families reference shows the table as
it is, and a known family's refusal comes from config.json alone, without importing vLLM."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3x import families
from eagle3x.families import FAMILIES, family_of
from tests.config.test_refusals import HEAVY, refused
from eagle3x.testing import zoo

ROOT = Path(__file__).resolve().parents[1]


def test_each_architecture_belongs_to_one_row_and_each_row_to_a_zoo_checkpoint():
    names = [a for f in FAMILIES for a in f.architectures]
    assert len(names) == len(set(names))
    for f in FAMILIES:
        assert f.zoo in zoo.FAMILIES, f.name
        assert all(family_of([a]) is f for a in f.architectures)
    assert family_of(["NoSuchForCausalLM"]) is None
    assert "not in eagle3x's family table" in families.describe(["NoSuchForCausalLM"], False)
    assert families.describe(["Qwen2_5_VLForConditionalGeneration"], True).endswith(
        "language model under text_config")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.zoo)
def test_the_zoo_checkpoint_is_read_as_its_row(family, cache_dir, tiny_verifier):
    """What the zoo builds (the family's own transformers config class) names an
    architecture of its row, and a wrapper is seen through text_config."""
    from eagle3x.verifier import read_info

    info = read_info(zoo.build(family.zoo, cache_dir / "zoo" / family.zoo, tiny_verifier))
    assert family_of(info.architectures) is family
    assert info.wrapped is family.wrapper


@pytest.mark.vllm
def test_every_rows_vllm_claim_holds_in_the_installed_vllm():
    """Each architecture: vLLM registers it; its class implements SupportsEagle3 exactly
    when the row says vLLM extracts it; a row's extra modules are what its module imports."""
    pytest.importorskip("vllm")
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from eagle3x.engines.vllm import _import_failure

    assert vllm.__version__.startswith(families.VLLM_TESTED), vllm.__version__
    for f in FAMILIES:
        for arch in f.architectures:
            assert arch in ModelRegistry.get_supported_archs(), arch
            missing = [m for m in f.vllm_needs if importlib.util.find_spec(m) is None]
            cls = ModelRegistry._try_load_model_cls(arch)
            if missing:
                assert cls is None, arch
                why = _import_failure(ModelRegistry.models[arch])
                assert why and all(m in why for m in missing), (arch, why)
                continue
            assert cls is not None, arch
            assert bool(supports_eagle3(cls)) is f.vllm_extracts, (arch, cls)


def test_the_families_reference_shows_the_table():
    page = (ROOT / "docs" / "reference" / "families.md").read_text(encoding="utf-8")
    assert families.markdown() in page, (
        "docs/reference/families.md's support table differs from eagle3x.families; "
        "regenerate it with `python -m eagle3x.docs`")


def named(tiny_verifier: Path, tmp_path: Path, arch: str) -> Path:
    verifier = tmp_path / arch
    shutil.copytree(tiny_verifier, verifier)
    cfg = json.loads((verifier / "config.json").read_text())
    cfg["architectures"] = [arch]
    (verifier / "config.json").write_text(json.dumps(cfg))
    return verifier


@pytest.mark.parametrize("arch,needle", [
    ("Gemma3ForCausalLM", "SupportsEagle3"),
    ("Qwen2_5_VLForConditionalGeneration", "imports torchvision")])
@pytest.mark.slow
def test_a_known_family_vllm_cannot_take_is_refused_at_startup_without_importing_vllm(
        cli, tiny_verifier, tmp_path, arch, needle):
    if "torchvision" in needle and importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    verifier = named(tiny_verifier, tmp_path, arch)
    args = ["stage=all", "verifier=local", f"verifier.path={verifier}", "experiment=tiny",
            "engine=vllm", "eval.live=true", "logger=none"]
    err = refused(cli(*args), arch, needle, "engine=vllm", "engine=hf", "eval.live=true")
    assert "Traceback" not in err
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eagle3x", *args],
                       cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 2
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported and not imported & set(HEAVY), imported & set(HEAVY)
    # engine=hf extracts it; without eval.live nothing asks vLLM for it
    ok = cli("--plan", "engine=hf",
             *[a for a in args if a not in ("engine=vllm", "eval.live=true")])
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["verifier"]["family"].startswith(family_of([arch]).name)


def problems(argv, gpus: str, monkeypatch) -> list:
    from eagle3x.__main__ import validate

    monkeypatch.setenv("EAGLE3X_GPU_COUNT", gpus)
    return validate(argv, [])


def test_what_vllm_cannot_run_of_a_quantized_or_float16_checkpoint_is_refused_at_startup(
        store, cache_dir, tiny_verifier, monkeypatch):
    """Decided from config.json (quantization_config, routed_scaling_factor), each rule
    citing the vLLM source it reads (eagle3x.families.vllm_checkpoint_problem)."""
    from eagle3x.checks import preflight
    from eagle3x.checks.preflight import _cpu_has_amx

    w4 = zoo.build_w4a16("llama", cache_dir / "zoo" / "llama_w4a16_all", tiny_verifier)
    kimi = zoo.build_w4a16("deepseek_v3", cache_dir / "zoo" / "deepseek_v3_w4a16_experts",
                           tiny_verifier, r"mlp\.experts\.\d+\.")
    dsv3 = zoo.build("deepseek_v3", cache_dir / "zoo" / "deepseek_v3", tiny_verifier)

    def found(verifier, *args, gpus="0", engine="vllm"):
        argv = ["stage=extract", "verifier=local", f"verifier.path={verifier}",
                "experiment=tiny", f"engine={engine}", *args]
        return [p for p in problems(argv, gpus, monkeypatch) if p.key in ("engine", "engine.dtype")]

    # int4 linear layers on vLLM's CPU build: no float32 kernel; bfloat16 / float16 run
    # where the library loaded has the int4 GEMM (AVX-512; set here both ways)
    monkeypatch.setattr(preflight, "_vllm_cpu_has_int4", lambda: True)
    (p,) = found(w4, "engine.dtype=float32")
    assert p.key == "engine.dtype" and "CPUWNA16LinearKernel" in p.message
    assert p.where == "command line" and "bfloat16" in p.hint
    assert not found(w4) and not found(w4, "engine.dtype=float16")
    assert not found(w4, "engine.dtype=float32", gpus="1")  # CUDA kernels take float32 in
    # the AVX2 library has no int4 GEMM in any dtype (tests/engines/test_zoo_vllm.py probes it)
    monkeypatch.setattr(preflight, "_vllm_cpu_has_int4", lambda: False)
    for dtype in ("auto", "float16", "bfloat16"):
        (p,) = found(w4, f"engine.dtype={dtype}")
        assert p.key == "engine" and "cpu_gemm_wna16" in p.message and "engine=hf" in p.hint
    assert not found(w4, gpus="1") and not found(w4, engine="hf")
    # Kimi-K2.5's layout (int4 routed experts): no int4 MoE kernel on a CPU without AMX
    if not _cpu_has_amx():
        (p,) = found(kimi, "engine.dtype=bfloat16")
        assert p.key == "engine" and "No WNA16 MoE backend" in p.message and "engine=hf" in p.hint
    assert not found(kimi, "engine.dtype=bfloat16", gpus="1")
    # DeepSeek in float16: vLLM rescales the residual stream (and the aux states) by 1/2.5
    for gpus in ("0", "1"):
        (p,) = found(dsv3, "engine.dtype=float16", gpus=gpus)
        assert "1/routed_scaling_factor (1/2.5)" in p.message and p.hint == "engine.dtype=bfloat16"
    assert not found(dsv3, "engine.dtype=bfloat16")
    assert not found(w4, "engine.dtype=float32", engine="hf")  # transformers dequantizes
