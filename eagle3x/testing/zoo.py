"""The verifier zoo: tiny random checkpoints of every model family eagle3x claims to serve.

Each family is a transformers config built with the family's own config class, in one
common tiny shape (8 decoder layers, hidden 128, 2 heads of head_dim 64 where the family
allows it, vocabulary 1024 = the embedded tiny tokenizer's, float32), but carrying the
fields real checkpoints of that family carry (YaRN rope, MLA ranks, experts, soft-cap,
sliding windows, a multimodal wrapper). `build(name, folder, tokenizer_from)` makes the
checkpoint locally with `save_pretrained` (nothing is downloaded) and copies the tiny
verifier's tokenizer beside it, so the folder opens like any real verifier folder.

Weights are random (fixed seed) but larger than transformers' default init (std 0.1 on
every matrix, norm weights and biases perturbed too), so hidden states and logits are far
from uniform and a wrong layer, a missing final norm or a missing soft-cap shows.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

#: Change when anything below changes what a built checkpoint is (the folder is rebuilt).
ZOO_ID = "zoo-v1"
#: Written last into a finished folder; its presence (with ZOO_ID inside) means complete.
MARKER = "eagle3x_zoo.json"
SEED = 0
INIT_STD = 0.1

#: Tokenizer files copied from the tiny verifier (those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model")

#: The embedded tiny tokenizer's special ids (eagle3x/tiny.py: <pad>=0, <s>=1, <|im_end|>=3).
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 3}

COMMON = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    initializer_range=0.02,
    **TOKENS,
)


class ZooBuildError(RuntimeError):
    """A family that the installed transformers cannot build; the message says why."""


def _dtype(cfg):
    cfg.dtype = "float32"
    return cfg


def llama():
    from transformers import LlamaConfig

    return _dtype(LlamaConfig(**COMMON, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def qwen2():
    from transformers import Qwen2Config

    # Qwen2 / Qwen2.5: bias on q, k, v; GQA.
    return _dtype(Qwen2Config(**COMMON, num_key_value_heads=1, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default",
                                               "rope_theta": 1000000.0}))


def qwen3():
    from transformers import Qwen3Config

    # Qwen3: q/k RMSNorm per head, explicit head_dim, GQA.
    return _dtype(Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default",
                                               "rope_theta": 1000000.0}))


def mistral():
    from transformers import MistralConfig

    return _dtype(MistralConfig(**COMMON, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                                sliding_window=None,
                                rope_parameters={"rope_type": "default",
                                                 "rope_theta": 1000000.0}))


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return _dtype(Qwen3MoeConfig(**COMMON, num_key_value_heads=1, head_dim=64,
                                 rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=64, decoder_sparse_step=1,
                                 norm_topk_prob=True, mlp_only_layers=[],
                                 rope_parameters={"rope_type": "default",
                                                  "rope_theta": 1000000.0}))


def gpt_oss():
    from transformers import GptOssConfig

    # gpt-oss-20b/120b carry YaRN: factor 32 over 4096 original positions (131072); here
    # the same factor over 64 original positions, so factor * original = 2048. Alternating
    # sliding (window 128 real; 16 here, so the test sequences cross it) and full layers,
    # attention sinks, biased attention and experts.
    fields = dict(COMMON, intermediate_size=64)
    return _dtype(GptOssConfig(
        **fields, num_key_value_heads=1, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention"] * 4,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0}))


def gemma3():
    from transformers import Gemma3TextConfig

    # Text-only Gemma 3 (Gemma3ForCausalLM). Its embeddings are tied in every real
    # checkpoint (and vLLM's Gemma3ForCausalLM always reads the embedding as its head), so
    # tie_word_embeddings stays True. Sliding window 16 (real: 512 / 1024) so the test
    # sequences cross it; 5 sliding : 1 full as real; final soft-cap 30 (Gemma 2's value)
    # so the cap is exercised.
    fields = dict(COMMON, tie_word_embeddings=True)
    return _dtype(Gemma3TextConfig(
        **fields, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=16, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default",
                                            "rope_theta": 1000000.0}}))


def deepseek_v3():
    from transformers import DeepseekV3Config

    # MLA as DeepSeek-V3 / Kimi-K2 carry it (kv_lora_rank 512, qk_rope_head_dim 64, a
    # q_lora_rank, interleaved rope), one dense layer first then MoE layers with one shared
    # expert and sigmoid, group-limited routing; YaRN rope scaling in the real checkpoints'
    # legacy `rope_scaling` form (factor 40 over 4096 real; 32 over 64 here).
    fields = dict(COMMON)
    return _dtype(DeepseekV3Config(
        **fields, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=96,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
        # carried by the real config.json files (read by vLLM / SGLang, not transformers)
        moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc", ep_size=1,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "rope_theta": 10000.0}))


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    # The language model under text_config (multimodal rope: mrope_section sums to
    # head_dim / 2); a two-block vision tower. The vision special ids sit at the top of
    # the 1024-token vocabulary, outside the ids the tests feed (3..1000).
    text = dict(COMMON, num_key_value_heads=1, rms_norm_eps=1e-6, max_window_layers=8,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": [8, 12, 12]})
    text.pop("tie_word_embeddings")
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                  "out_hidden_size": 128, "fullatt_block_indexes": [1], "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112}
    return _dtype(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                   image_token_id=1020, video_token_id=1021,
                                   vision_start_token_id=1022, vision_end_token_id=1023,
                                   tie_word_embeddings=False))


def qwen2_5_vl_tied():
    """The wrapper with a tied head: transformers 5 writes the flag only at the top level
    and the checkpoint holds no lm_head.weight."""
    cfg = qwen2_5_vl()
    cfg.tie_word_embeddings = True
    return cfg


FAMILIES: OrderedDict[str, Callable[[], object]] = OrderedDict([
    ("llama", llama),
    ("qwen2", qwen2),
    ("qwen3", qwen3),
    ("mistral", mistral),
    ("qwen3_moe", qwen3_moe),
    ("gpt_oss", gpt_oss),
    ("gemma3", gemma3),
    ("deepseek_v3", deepseek_v3),
    ("qwen2_5_vl", qwen2_5_vl),
    ("qwen2_5_vl_tied", qwen2_5_vl_tied),
])

#: Families whose checkpoint is a multimodal wrapper, not an AutoModelForCausalLM.
WRAPPERS: dict[str, str] = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                            "qwen2_5_vl_tied": "Qwen2_5_VLForConditionalGeneration"}


def model_class(name: str):
    """The transformers class a family's checkpoint is saved from and reloaded as."""
    import transformers

    if name in WRAPPERS:
        return getattr(transformers, WRAPPERS[name])
    return transformers.AutoModelForCausalLM


def _perturb(model) -> None:
    """Larger-than-default random weights: every matrix normal(0, INIT_STD); biases
    normal(0, INIT_STD); norm weights moved off their init (1, or 0 for Gemma's 1 + w) by
    normal(0, INIT_STD), so a final norm applied without its weight would show."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2 or pname.endswith("bias"):
                p.normal_(0.0, INIT_STD)
            elif pname.endswith("weight") and "norm" in pname.split(".")[-2]:
                p.add_(torch.randn_like(p) * INIT_STD)


def _make(name: str, out: Path, tokenizer_from: Path, fit: bool = False) -> None:
    import torch

    cfg = FAMILIES[name]()
    torch.manual_seed(SEED)
    cls = model_class(name)
    if hasattr(cls, "from_config"):  # an Auto class
        model = cls.from_config(cfg, dtype=torch.float32)
    else:
        model = cls._from_config(cfg, dtype=torch.float32)
    if fit:  # from transformers' own init, as the embedded tiny verifier is fitted
        from transformers import AutoTokenizer

        from eagle3x import tiny

        tiny._fit(model, AutoTokenizer.from_pretrained(tokenizer_from))
    else:
        _perturb(model)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    copied = []
    for fname in TOKENIZER_FILES:
        src = Path(tokenizer_from) / fname
        if src.is_file():
            shutil.copyfile(src, out / fname)
            copied.append(fname)
    if "tokenizer.json" not in copied:
        raise ZooBuildError(f"{tokenizer_from}: no tokenizer.json to copy")


def build(name: str, folder: str | Path, tokenizer_from: str | Path, fit: bool = False) -> Path:
    """The family `name`'s tiny checkpoint at `folder`, built unless a complete one is there.

    `fit`: instead of the perturbed random weights, fit it briefly to the bundled
    conversations (`eagle3x.tiny._fit`, as the embedded verifier), so that a draft trained
    beside it has something to predict (benchmarks; minutes on a CPU).

    Built into a temporary folder beside it and renamed, under a file lock. Raises
    ZooBuildError naming the family, the transformers version and the error when the
    installed transformers cannot build the family.
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown zoo family {name!r}; known: {list(FAMILIES)}")

    def make(tmp: Path) -> None:
        try:
            _make(name, tmp, Path(tokenizer_from), fit)
        except ZooBuildError:
            raise
        except Exception as exc:  # the installed transformers cannot build it
            import transformers

            raise ZooBuildError(
                f"zoo family {name!r} cannot be built with transformers "
                f"{transformers.__version__}: {type(exc).__name__}: {exc}") from exc

    return _publish(Path(folder), {"zoo_id": ZOO_ID, "family": name, "fit": fit}, make)


def _publish(folder: Path, tag: dict, make: Callable[[Path], None]) -> Path:
    """`folder`, made by make(tmp) in a temporary folder beside it and renamed, under a
    file lock, unless a folder with the same marker `tag` is already there."""
    if _tagged(folder, tag):
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if _tagged(folder, tag):
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        os.chmod(tmp, 0o755)
        try:
            make(tmp)
            with open(tmp / MARKER, "w", encoding="utf-8") as f:
                json.dump(tag, f)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_w4a16(name: str, folder: str | Path, tokenizer_from: str | Path,
                only: str | None = None, reference: bool = False) -> Path:
    """The family `name`'s zoo checkpoint quantized as compressed-tensors W4A16 (int4
    weights in groups of 32, symmetric; eagle3x/testing/quant.py) at `folder`: every linear
    layer but the head, or those matching `only` (Kimi-K2.5 quantizes only the routed
    experts: only=r"mlp\\.experts\\.\\d+\\."). `reference=True` writes instead the float
    checkpoint whose weights are exactly the dequantized int4 values."""
    from eagle3x.testing import quant

    folder = Path(folder)
    tag = {"zoo_id": ZOO_ID, "family": name, "w4a16": only or "all", "reference": reference}
    base = build(name, folder.parent / name, tokenizer_from)
    write = quant.write_dequantized if reference else quant.quantize
    return _publish(folder, tag, lambda tmp: write(base, tmp, 32, only))


def _tagged(folder: Path, tag: dict) -> bool:
    try:
        with open(folder / MARKER, encoding="utf-8") as f:
            return json.load(f) == tag
    except (OSError, ValueError):
        return False
