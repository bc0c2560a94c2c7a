"""The draft's rotary embedding in training is the one the serving engines build from the
exported config.json, for verifiers with large rope_theta and rope scaling.

eagle3x trains the draft with plain rotary embedding at the verifier's base theta
(`eagle3x.draft.model.rope`) and exports `rope_theta` with no scaling keys. vLLM builds the
draft's rotary embedding from that config.json: `vllm/transformers_utils/config.py`,
`get_config` (which standardises `rope_theta` into `rope_parameters`), then
`vllm/config/speculative.py`, `SpeculativeConfig._maybe_override_draft_max_position_embeddings`
(raises the draft's max_position_embeddings to the verifier's max_model_len), then
`vllm/model_executor/models/llama.py`, `LlamaAttention._init_rotary_emb` ->
`get_rope(head_dim, max_position, rope_parameters=config.rope_parameters,
is_neox_style=True)`, which `llama_eagle3.LlamaDecoderLayer` inherits. SGLang's
`LlamaForCausalLMEagle3` builds `get_rope(head_dim, rotary_dim, max_position, rope_theta,
rope_scaling)` from the same file's `rope_theta` and (absent) `rope_scaling`.
Here the real vLLM functions build it and rotate the same vectors as training does, at
positions past the verifiers' original context.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from eagle3x.draft.model import DraftShape, rope
from eagle3x.draft.save import draft_config
from eagle3x.draft.shape import draft_shape
from eagle3x.verifier import VerifierInfo

BASE = dict(num_hidden_layers=8, hidden_size=256, vocab_size=1024, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=512, max_position_embeddings=131072)

#: The rope settings of real checkpoints' config.json, in the form each ships it.
VERIFIERS = {
    # Llama-3.1-8B-Instruct: llama3 scaling, theta 500000, legacy rope_scaling key
    "llama3.1": dict(architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    # Qwen3: theta 1e6, no scaling
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], rope_theta=1000000.0, head_dim=128,
                  max_position_embeddings=40960),
    # DeepSeek-V3 / Kimi-K2: YaRN, legacy form, theta 10000 (head_dim from hidden / heads)
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], rope_theta=10000.0,
                        kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32,
                                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096}),
    # gpt-oss: YaRN in transformers 5's rope_parameters form, theta inside
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], head_dim=64,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                     "original_max_position_embeddings": 4096}),
}


def vllm_rope(head_dim: int, max_position: int, params):
    """vLLM's get_rope as its model classes call it (inside a vLLM config context, as
    during model construction: its rotary layers are CustomOps)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_dim, max_position=max_position, rope_parameters=params,
                        is_neox_style=True, dtype=torch.float32)


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_vllm_builds_the_draft_rope_eagle3x_trained(name, tmp_path):
    pytest.importorskip("vllm")
    from vllm.config.speculative import SpeculativeConfig
    from vllm.transformers_utils.config import get_config

    raw = dict(BASE, **VERIFIERS[name])
    ref = SimpleNamespace(info=VerifierInfo.from_config(raw), rms_norm_eps=1e-5)
    shape = DraftShape(**draft_shape(ref, draft_vocab=512))
    exported = draft_config(shape, [1, 3, 4], torch.float32, raw["architectures"])
    assert not {"rope_scaling", "rope_parameters"} & set(exported)  # what SGLang reads: none
    (tmp_path / "config.json").write_text(json.dumps(exported))

    hf = get_config(str(tmp_path), trust_remote_code=False)
    SpeculativeConfig._maybe_override_draft_max_position_embeddings(hf, 262144)
    served = vllm_rope(hf.head_dim, hf.max_position_embeddings,
                       getattr(hf, "rope_parameters", None))

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(0, 64), torch.tensor([4095, 4096, 8191, 8192, 40000,
                                                              131071, 200000])])
    t, heads, kv, d = len(positions), shape.num_heads, shape.num_kv_heads, shape.head_dim
    q, k = torch.randn(t, heads * d), torch.randn(t, kv * d)
    vq, vk = served.forward_native(positions, q.clone(), k.clone())
    ours_q = rope(q.view(1, t, heads, d).transpose(1, 2), positions[None], shape.rope_theta)
    ours_k = rope(k.view(1, t, kv, d).transpose(1, 2), positions[None], shape.rope_theta)
    torch.testing.assert_close(vq.view(t, heads, d), ours_q[0].transpose(0, 1),
                               rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(vk.view(t, kv, d), ours_k[0].transpose(0, 1),
                               rtol=1e-4, atol=2e-4)
    theta = (raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"])
    assert shape.rope_theta == theta  # the verifier's base frequency, not 10000 by default


@pytest.mark.vllm
def test_exporting_the_verifiers_rope_scaling_would_fail_the_comparison():
    """Had the export copied Llama 3.1's llama3 scaling (as some peers' draft configs do)
    without training with it, vLLM's draft would rotate differently from training."""
    pytest.importorskip("vllm")
    params = dict(VERIFIERS["llama3.1"]["rope_scaling"], rope_theta=500000.0)
    scaled = vllm_rope(64, 131072, params)
    torch.manual_seed(0)
    positions = torch.arange(0, 9000, 7)
    q = torch.randn(len(positions), 64)
    vq, _ = scaled.forward_native(positions, q.clone(), q.clone())
    ours = rope(q.view(1, -1, 1, 64).transpose(1, 2), positions[None], 500000.0)[0, 0]
    assert (vq - ours).abs().max() > 0.1
