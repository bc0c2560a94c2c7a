"""The verifier writing replies (stage regenerate): vLLM offline, or transformers.

Both take token-id prompts (the chat template is applied by the caller, with the
template's own generation prompt) and return, per prompt, the new token ids up to and
excluding the verifier's stop token, and whether the reply hit the token limit instead.
Stop tokens are the verifier's: generation_config.json's ``eos_token_id`` (one or a
list), else the tokenizer's. vLLM stops there by itself (it reads the same file); the HF
engine is told them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Sequence, Set

import torch


class Reply(NamedTuple):
    token_ids: List[int]
    #: stopped at max_new_tokens (or the context) rather than at a stop token
    hit_length: bool


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def stop_ids(verifier: Path, tokenizer: Any) -> Set[int]:
    """The verifier's end-of-generation token ids."""
    ids: Set[int] = set()
    try:
        gen = json.loads((Path(verifier) / "generation_config.json").read_text())
        eos = gen.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except (OSError, ValueError):
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _cut(tokens: Sequence[int], stops: Set[int], limit: int) -> Reply:
    for i, t in enumerate(tokens):
        if t in stops:
            return Reply(list(tokens[:i]), False)
    return Reply(list(tokens), len(tokens) >= limit)


class VLLMGenerator:
    """vLLM's offline engine with prefix caching (turns of one conversation share a prefix).
    Its errors come out as `EngineFailed`; its start is shown phase by phase."""

    def __init__(self, verifier: Path, settings: Dict[str, Any], context: int, stops: Set[int]):
        from eagle3x.engines.base import failing_as, mla_attention, set_rpc_timeout
        from eagle3x.engines.watch import StartWatch

        self.stops = stops
        self.rpc_timeout = set_rpc_timeout(settings)
        kw = dict(model=str(verifier), tensor_parallel_size=settings["tensor_parallel_size"],
                  dtype=settings["dtype"], enforce_eager=settings["enforce_eager"],
                  quantization=settings["quantization"],
                  trust_remote_code=settings["trust_remote_code"],
                  gpu_memory_utilization=settings["gpu_memory_utilization"],
                  max_model_len=context, enable_prefix_caching=True)
        if settings.get("max_num_batched_tokens"):
            kw["max_num_batched_tokens"] = settings["max_num_batched_tokens"]
        kw.update(mla_attention(settings))
        with StartWatch("vllm") as watch:
            self.offset = watch.offset
            with failing_as("vllm", "start", self.offset, self.rpc_timeout):
                from vllm import LLM

                self.llm = LLM(**{k: v for k, v in kw.items() if v is not None})
        self.started = watch.summary()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 limits: Sequence[int], seeds: Sequence[int]) -> List[Reply]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=limit, seed=seed,
                                 stop_token_ids=sorted(self.stops))
                  for limit, seed in zip(limits, seeds)]
        from eagle3x.engines.base import failing_as

        with failing_as("vllm", "generate", self.offset, self.rpc_timeout):
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p)))
                                      for p in prompts], params, use_tqdm=False)
        replies = []
        for o, limit in zip(outs, limits):
            c = o.outputs[0]
            reply = _cut(list(c.token_ids), self.stops, limit)
            replies.append(Reply(reply.token_ids, c.finish_reason == "length"))
        return replies

    def close(self) -> None:
        from eagle3x.engines.base import shutdown_llm

        try:
            shutdown_llm(getattr(self, "llm", None))
        except Exception:  # a dead engine: its processes are gone or going
            pass
        self.llm = None


class HFGenerator:
    """transformers' generate, one prompt at a time (the reference; small models)."""

    def __init__(self, verifier: Path, dtype: str, device: str, trust_remote_code: bool,
                 stops: Set[int]):
        from transformers import AutoModelForCausalLM

        from eagle3x.engines.watch import HF_LOADING, StartWatch
        from eagle3x.weights import torch_dtype

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.stops = stops
        with StartWatch("hf", phases=(), first=HF_LOADING) as watch:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(verifier), dtype=torch_dtype(dtype), use_safetensors=True,
                trust_remote_code=trust_remote_code).to(self.device).eval()
        self.offset, self.started = watch.offset, ""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 limits: Sequence[int], seeds: Sequence[int]) -> List[Reply]:
        from eagle3x.engines.base import failing_as

        with failing_as("hf", "generate", self.offset):
            return self._generate(prompts, sampling, limits, seeds)

    @torch.inference_mode()
    def _generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                  limits: Sequence[int], seeds: Sequence[int]) -> List[Reply]:
        replies = []
        for prompt, limit, seed in zip(prompts, limits, seeds):
            ids = torch.tensor([list(map(int, prompt))], device=self.device)
            sample = sampling.temperature > 0
            if sample:
                torch.manual_seed(seed)
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit,
                do_sample=sample, temperature=sampling.temperature if sample else None,
                top_p=sampling.top_p if sample else None, top_k=None,
                eos_token_id=sorted(self.stops) or None,
                pad_token_id=next(iter(self.stops), 0))
            replies.append(_cut(out[0, ids.shape[1]:].tolist(), self.stops, limit))
        return replies

    def close(self) -> None:
        self.model = None
