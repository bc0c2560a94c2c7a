"""What each serving engine reads from an export: vLLM through its own functions, SGLang
through its rule as read from its source (it cannot run here: it needs CUDA)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Sequence

import pytest
import torch

from eagle3x.draft.save import draft_config
from eagle3x.verifier import aux_layer_problem

LLAMA, QWEN3, DSV3, GPTOSS = ("LlamaForCausalLM",), ("Qwen3ForCausalLM",), \
    ("DeepseekV3ForCausalLM",), ("GptOssForCausalLM",)


def export_config(ids: Sequence[int], architectures: Sequence[str] = LLAMA) -> dict:
    from eagle3x.draft.model import DraftShape

    shape = DraftShape(128, 128, 256, 4, 1, 32, 256, 1024)
    return draft_config(shape, list(ids), torch.bfloat16, architectures)


# -- SGLang, pinned from sglang 0.5.23 ----------------------------------------------------


def sglang_capture_positions(config: dict, architectures: Sequence[str],
                             num_layers: int) -> List[int]:
    """Where SGLang's target captures aux hidden states, as its source decides it:
    srt/model_executor/model_runner_components/spec_aux_hidden_state.py,
    `_resolve_eagle_aux_hidden_state` (nested key only, None when missing), then the
    target's `set_eagle3_layers_to_capture`: srt/models/llama.py and qwen3.py add 1 (the
    default is used as is); srt/models/deepseek_v2.py adds 1 only when ids[0] == 1;
    srt/models/gpt_oss.py keeps ids whose max is N, else adds 1."""
    try:
        ids: Optional[List[int]] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    n = num_layers
    if ids is None:
        return [2, n // 2, n - 3]
    arch = architectures[0]
    if arch == "DeepseekV3ForCausalLM":
        return [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)
    if arch == "GptOssForCausalLM":
        return list(ids) if ids and max(ids) == n else [v + 1 for v in ids]
    return [v + 1 for v in ids]


def sglang_captured_outputs(positions: Sequence[int], num_layers: int) -> List[int]:
    """srt/models/llama.py, `LlamaModel.forward`: position i is captured as layer i's input
    (hidden_states + residual before layer i runs, i in range(N)): the output of layer i-1.
    A position outside the loop is never captured."""
    return [i - 1 for i in range(num_layers) if i in positions]


@pytest.mark.parametrize("arch", [LLAMA, QWEN3, DSV3, GPTOSS], ids=lambda a: a[0])
@pytest.mark.parametrize("n", [8, 61])
def test_sglang_captures_exactly_the_trained_layers_for_every_id_set_eagle3x_accepts(arch, n):
    pool = range(n) if n <= 8 else [0, 1, 2, 3, 29, 30, 56, 57, 58, 59, 60]
    accepted = 0
    for ids in itertools.combinations(pool, 3):
        if aux_layer_problem(ids, n, arch):
            continue
        accepted += 1
        positions = sglang_capture_positions(export_config(ids, arch), arch, n)
        assert sglang_captured_outputs(positions, n) == list(ids), (arch, ids, positions)
    assert accepted


def test_the_previous_export_fed_sglang_layers_one_deeper():
    """The k+1 nested ids of the old export: what this test guards against."""
    positions = sglang_capture_positions(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}, LLAMA, 8)
    assert sglang_captured_outputs(positions, 8) == [2, 4, 5] != [1, 3, 4]


def test_the_ids_eagle3x_refuses_are_the_ones_sglang_would_not_capture():
    for ids, arch in (([1, 3, 7], LLAMA), ([0, 3, 5], DSV3)):
        assert aux_layer_problem(ids, 8, arch)
        positions = sglang_capture_positions(export_config(ids, arch), arch, 8)
        assert sglang_captured_outputs(positions, 8) != list(ids)


# -- vLLM, through its own resolution functions -------------------------------------------


def resolve_with_vllm(verifier: Path, draft: Path) -> dict:
    """The aux layer ids each vLLM model runner resolves for this draft, from a real
    SpeculativeConfig (which loads the draft's config.json as vLLM serves it)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    target = ModelConfig(model=str(verifier), dtype="float32")
    spec = SpeculativeConfig(method="eagle3", model=str(draft), num_speculative_tokens=3,
                             target_model_config=target, target_parallel_config=ParallelConfig())
    runner_v1 = SimpleNamespace(speculative_config=spec)
    return {"v2": get_eagle3_aux_layers_from_config(spec),
            "v1": GPUModelRunner._get_eagle3_aux_layers_from_config(runner_v1)}


def save_tiny_draft(verifier: Path, ids: Sequence[int], out: Path) -> Path:
    from eagle3x.draft.model import DraftShape, Eagle3Draft
    from eagle3x.draft.save import save
    from eagle3x.plan import VerifierRef
    from eagle3x.draft.shape import draft_shape
    from eagle3x.verifier import read_info

    ref = VerifierRef(path=verifier, tiny=False, trust_remote_code=False, fingerprint="",
                      info=read_info(verifier))
    shape = DraftShape(**draft_shape(ref, 256))
    chosen = torch.randperm(shape.target_vocab_size, generator=torch.Generator().manual_seed(0))[:256].sort().values
    t2d = torch.zeros(shape.target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return save(Eagle3Draft(shape, chosen - torch.arange(256), t2d), out, list(ids))


@pytest.mark.vllm
@pytest.mark.parametrize("ids", [[1, 3, 4], [0, 3, 5]], ids=["default", "custom"])
def test_both_vllm_model_runners_resolve_the_trained_layers(ids, tiny_verifier, tmp_path):
    pytest.importorskip("vllm")
    draft = save_tiny_draft(tiny_verifier, ids, tmp_path / "draft")
    resolved = resolve_with_vllm(tiny_verifier, draft)
    # vllm/model_executor/models/llama.py, LlamaModel.forward: id j is captured after
    # decoder layer j-1 runs (`_maybe_add_hidden_state(..., idx + 1, ...)`)
    for runner, got in resolved.items():
        assert got is not None and [j - 1 for j in got] == ids, (runner, got)


@pytest.mark.vllm
def test_vllm_v2_ignores_a_nested_only_export(tiny_verifier, tmp_path):
    """The previous export (nested ids only): vLLM's GPU runner fell back to its default."""
    import json

    pytest.importorskip("vllm")
    draft = save_tiny_draft(tiny_verifier, [0, 3, 5], tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = cfg.pop("eagle_aux_hidden_state_layer_ids")
    (draft / "config.json").write_text(json.dumps(cfg))
    resolved = resolve_with_vllm(tiny_verifier, draft)
    assert resolved["v2"] is None and resolved["v1"] == (1, 4, 6)


# -- SGLang's model registry, pinned from sglang 0.5.23 -------------------------------------
#: srt/models/registry.py keys its models by the class names in each module's EntryClass;
#: srt/models/llama_eagle3.py's EAGLE-3 Llama draft is LlamaForCausalLMEagle3 (no other
#: name of it is registered).
SGLANG_EAGLE3_LLAMA = {"LlamaForCausalLMEagle3"}


@pytest.mark.parametrize("option,value", [(None, None), ("norm_before_fc", True),
                                          ("fc_norm", True), ("norm_before_residual", True),
                                          ("norm_output", True), ("num_layers", 2),
                                          ("sliding_window", 64)])
@pytest.mark.slow
def test_a_draft_sglang_would_compute_otherwise_is_named_so_sglang_refuses_it(option, value):
    """Every export loads in vLLM (its registry, read from the installed package, maps
    both names to llama_eagle3's Eagle3LlamaForCausalLM); only a draft SGLang computes as
    trained carries the name SGLang's registry holds."""
    import dataclasses

    from eagle3x.draft.model import DraftShape
    from eagle3x.serving import vllm_only

    shape = DraftShape(128, 128, 256, 4, 1, 32, 256, 1024)
    if option:
        shape = dataclasses.replace(shape, **{option: value})
    [arch] = draft_config(shape, [0, 3, 5], torch.bfloat16, LLAMA)["architectures"]
    assert (arch in SGLANG_EAGLE3_LLAMA) == (option is None) == (not vllm_only(shape))
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    assert registry._SPECULATIVE_DECODING_MODELS[arch] == ("llama_eagle3", "Eagle3LlamaForCausalLM")
