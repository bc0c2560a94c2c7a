"""The verifier writing replies (stage regenerate, the greedy offline estimate): vLLM
offline, or transformers.

Both take token-id prompts (the chat template is applied by the caller, with the
template's own generation prompt) and give, per prompt, the new token ids up to and
excluding the verifier's stop token, and whether the reply hit the token limit instead.
Stop tokens are the verifier's: generation_config.json's ``eos_token_id`` (one or a
list), else the tokenizer's. vLLM stops there by itself (it reads the same file); the HF
engine is told them.

The generator API (both engines):

- ``submit(requests, sampling)``: queue `Request`s (a caller's key, the prompt, its token
  limit, its sampling seed);
- ``step(on_step)``: do some work and return the ``(key, Reply)`` of each request finished
  in it (vLLM: one engine step; transformers: one left-padded batch of up to `batch_size`
  requests decoded together). `on_step(tokens)` is called between decode steps with the
  tokens made since the last call; once it returns False the step ends early: what
  finished is returned, the unfinished requests stay queued (their partial tokens lost);
- ``pending()``: requests queued or running; ``cancel()``: drop them all;
- ``generate(prompts, sampling, limits, seeds)``: all of them, in order (submit + step).

A caller that stops on a signal calls `step` with an `on_step` that says so: it gets
control back within one decode step, with every reply finished until then.

`decode` is the transformers loop itself (also the greedy offline estimate's): a batch
left-padded with an attention mask and positions counted from each row's first token,
the KV cache reused, each row ending at its own stop token or limit (finished rows leave
the batch). At temperature 0 its replies are those of one-at-a-time greedy decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set,
                    Tuple)

import torch


class Reply(NamedTuple):
    token_ids: List[int]
    #: stopped at max_new_tokens (or the context) rather than at a stop token
    hit_length: bool


class Request(NamedTuple):
    #: the caller's name for it (transformers takes the lowest keys first)
    key: int
    prompt: Sequence[int]
    #: new tokens at most
    limit: int
    seed: int


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


#: called between decode steps with the tokens made since the last call; False: stop now
OnStep = Callable[[int], bool]
#: (input ids, attention mask, positions, cache) -> (next-token scores [rows, vocab], cache)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], Tuple[torch.Tensor, Any]]


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


def _pick(scores: torch.Tensor, sampling: Sampling,
          generators: Optional[List[torch.Generator]]) -> List[int]:
    """Each row's next token: argmax at temperature 0, else sampled (temperature, top-p)
    with the row's own generator."""
    scores = scores.float().cpu()
    if sampling.temperature <= 0 or generators is None:
        return scores.argmax(-1).tolist()
    probs = torch.softmax(scores / sampling.temperature, dim=-1)
    out = []
    for row, g in zip(probs, generators):
        if sampling.top_p < 1.0:
            p, order = row.sort(descending=True)
            cut = (p.cumsum(0) - p) >= sampling.top_p  # tokens past the nucleus
            p = p.masked_fill(cut, 0.0)
            out.append(int(order[torch.multinomial(p / p.sum(), 1, generator=g)]))
        else:
            out.append(int(torch.multinomial(row, 1, generator=g)))
    return out


def _select(cache: Any, keep: torch.Tensor) -> bool:
    """Keep only rows `keep` of a transformers cache (False where the cache cannot)."""
    try:
        cache.reorder_cache(keep)
        return True
    except (AttributeError, NotImplementedError, TypeError):
        return False


@torch.inference_mode()
def decode(forward: Forward, requests: Sequence[Request], sampling: Sampling, stops: Set[int],
           device: torch.device, on_step: Optional[OnStep] = None,
           prefill_tokens: int = 4096) -> Tuple[List[Tuple[int, Reply]], List[Request]]:
    """Decode `requests` together: (the finished ``(key, Reply)`` pairs, in the order they
    finished; the requests left unfinished because `on_step` returned False).

    The prompts are left-padded into one batch (attention mask 0 on the padding, positions
    counted from each row's first real token) and prefilled in slices of about
    `prefill_tokens` tokens over the batch (`on_step(0)` between slices, so a stop need not
    wait for a whole long prefill); then one token per row per step, the KV cache reused. A row ends at a token in `stops` (not part of its
    reply) or at its own `limit` (``hit_length``); finished rows leave the batch (their
    cache rows dropped) where the cache allows, else they ride along, ignored. Sampling
    rows each draw from a generator seeded with their request's seed."""
    rows = list(requests)
    if not rows:
        return [], []
    width = max(len(r.prompt) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.prompt)
        ids[i, width - n:] = torch.as_tensor(list(map(int, r.prompt)), dtype=torch.long)
        mask[i, width - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    gens = ([torch.Generator().manual_seed(int(r.seed)) for r in rows]
            if sampling.temperature > 0 else None)
    made: List[List[int]] = [[] for _ in rows]
    batch = list(range(len(rows)))  # the batch's rows in tensor order, as indices into `rows`
    live = set(batch)               # those still decoding (the others ride along, ignored)
    done: List[Tuple[int, Reply]] = []
    cache = None
    step = max(1, prefill_tokens // len(rows))  # prompt columns per prefill slice
    last = ((width - 1) // step) * step  # where the last slice starts (it makes token 1)
    for at in range(0, last, step):
        _, cache = forward(ids[:, at:at + step], mask[:, :at + step], pos[:, at:at + step],
                           cache)
        if on_step is not None and not on_step(0):
            return [], rows
    ids, pos = ids[:, last:], pos[:, last:]
    while live:
        scores, cache = forward(ids, mask, pos, cache)
        toks = _pick(scores, sampling, [gens[i] for i in batch] if gens else None)
        made_now = len(live)
        for i, t in zip(batch, toks):
            if i not in live:
                continue
            if t in stops:
                done.append((rows[i].key, Reply(made[i], False)))
                live.discard(i)
                continue
            made[i].append(t)
            if len(made[i]) >= rows[i].limit:
                done.append((rows[i].key, Reply(made[i], True)))
                live.discard(i)
        if not live:
            break
        if len(live) < len(batch):
            keep = [j for j, i in enumerate(batch) if i in live]
            sel = torch.tensor(keep, device=device)
            if _select(cache, sel):
                mask, pos, batch = mask[sel], pos[sel], [batch[j] for j in keep]
        nxt = [made[i][-1] if i in live else 0 for i in batch]
        ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        if on_step is not None and not on_step(made_now):
            return done, [rows[i] for i in batch if i in live]
    if on_step is not None:
        on_step(made_now)
    return done, []


class _Queued:
    """What both generators share: the queue's bookkeeping and `generate`."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 limits: Sequence[int], seeds: Sequence[int]) -> List[Reply]:
        """Every prompt's reply, in order (nothing else may be queued)."""
        self.submit([Request(k, p, lim, s) for k, (p, lim, s)
                     in enumerate(zip(prompts, limits, seeds))], sampling)
        got: Dict[int, Reply] = {}
        while self.pending():
            got.update(self.step())
        return [got[k] for k in range(len(prompts))]


class VLLMGenerator(_Queued):
    """vLLM's offline engine with prefix caching (turns of one conversation share a prefix),
    driven step by step (``LLM.enqueue``, ``llm_engine.step``, ``abort_request``) so a caller
    gets each reply as it finishes and can stop between steps. Its errors come out as
    `EngineFailed`; its start is shown phase by phase."""

    def __init__(self, verifier: Path, settings: Dict[str, Any], context: int, stops: Set[int]):
        from eagle3x.engines.base import failing_as, mla_attention, set_rpc_timeout
        from eagle3x.engines.watch import StartWatch

        self.stops = stops
        self.rpc_timeout = set_rpc_timeout(settings)
        self.queued: Dict[str, Tuple[int, int, str]] = {}  # id -> (key, limit, vLLM's id)
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

    def submit(self, requests: Sequence[Request], sampling: Sampling) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from eagle3x.engines.base import failing_as

        if not requests:
            return
        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=r.limit, seed=r.seed,
                                 stop_token_ids=sorted(self.stops)) for r in requests]
        with failing_as("vllm", "generate", self.offset, self.rpc_timeout):
            ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(map(int, r.prompt)))
                                    for r in requests], params, use_tqdm=False)
        for rid, r in zip(ids, requests):
            # outputs carry the id the request was given; enqueue answers vLLM's own
            # (that id, "-", a random suffix)
            self.queued[rid.rsplit("-", 1)[0]] = (r.key, r.limit, rid)

    def pending(self) -> int:
        return len(self.queued)

    def step(self, on_step: Optional[OnStep] = None) -> List[Tuple[int, Reply]]:
        """One engine step: the replies it finished (`on_step` gets their tokens; vLLM
        steps are short, so its answer matters only to the caller's next call)."""
        from eagle3x.engines.base import failing_as

        with failing_as("vllm", "generate", self.offset, self.rpc_timeout):
            outs = self.llm.llm_engine.step()
        got = []
        for o in outs:
            if not o.finished:
                continue
            if o.request_id not in self.queued:  # (else `pending` would never end)
                raise RuntimeError(f"vLLM finished request {o.request_id!r}, not one of "
                                   f"eagle3x's {sorted(self.queued)[:4]}...")
            key, limit, _ = self.queued.pop(o.request_id)
            c = o.outputs[0]
            reply = _cut(list(c.token_ids), self.stops, limit)
            got.append((key, Reply(reply.token_ids, c.finish_reason == "length")))
        if on_step is not None:
            on_step(sum(len(r.token_ids) for _, r in got))
        return got

    def cancel(self) -> None:
        """Abort every queued request (the engine forgets them)."""
        if self.queued and getattr(self, "llm", None) is not None:
            try:
                self.llm.llm_engine.abort_request([q[2] for q in self.queued.values()],
                                                  internal=True)
            except Exception:  # a dead engine has nothing to abort
                pass
        self.queued.clear()

    def close(self) -> None:
        from eagle3x.engines.options import shutdown_llm

        shutdown_llm(getattr(self, "llm", None))
        self.llm = None


class HFGenerator(_Queued):
    """transformers, `batch_size` requests decoded together (`decode`); the queue is taken
    lowest key first (regenerate's keys are conversation indices: the earliest
    conversations finish first, so a stop abandons the least)."""

    def __init__(self, verifier: Path, dtype: str, device: str, trust_remote_code: bool,
                 stops: Set[int], batch_size: int = 16):
        from transformers import AutoModelForCausalLM

        from eagle3x.engines.watch import HF_LOADING, StartWatch
        from eagle3x.weights import torch_dtype

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.stops, self.batch_size = stops, max(1, int(batch_size))
        self.prefill_tokens = 4096  # tokens per prefill slice (`decode`)
        self.queue: List[Tuple[Request, Sampling]] = []
        with StartWatch("hf", phases=(), first=HF_LOADING) as watch:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(verifier), dtype=torch_dtype(dtype), use_safetensors=True,
                trust_remote_code=trust_remote_code).to(self.device).eval()
        self.offset, self.started = watch.offset, ""

    def submit(self, requests: Sequence[Request], sampling: Sampling) -> None:
        self.queue += [(r, sampling) for r in requests]

    def pending(self) -> int:
        return len(self.queue)

    def cancel(self) -> None:
        self.queue.clear()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                 cache: Any) -> Tuple[torch.Tensor, Any]:
        kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                  past_key_values=cache, use_cache=True)
        try:  # only the last position's logits (a model without the option computes all)
            out = self.model(**kw, logits_to_keep=1)
        except TypeError:
            out = self.model(**kw)
        return out.logits[:, -1], out.past_key_values

    def step(self, on_step: Optional[OnStep] = None) -> List[Tuple[int, Reply]]:
        """One batch: the queued requests of lowest key (of one sampling), decoded until
        each ends or `on_step` says stop (the unfinished go back to the queue)."""
        from eagle3x.engines.base import failing_as

        if not self.queue:
            return []
        sampling = self.queue[0][1]
        same = sorted((k for k, (_, s) in enumerate(self.queue) if s == sampling),
                      key=lambda k: self.queue[k][0].key)[:self.batch_size]
        taken = set(same)
        batch = [self.queue[k][0] for k in same]
        self.queue = [q for k, q in enumerate(self.queue) if k not in taken]
        with failing_as("hf", "generate", self.offset):
            done, left = decode(self._forward, batch, sampling, self.stops, self.device, on_step,
                                self.prefill_tokens)
        self.queue = [(r, sampling) for r in left] + self.queue
        return done

    def close(self) -> None:
        self.model = None
