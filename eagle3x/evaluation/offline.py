"""The offline acceptance of a draft: no draft is served, the verifier's features are read.

Two figures (`eval.offline`; eval.json's ``measures`` names which one was scored):

- ``data`` (`evaluate`): from every trained position of the validation split the draft
  proposes `depth` tokens in a chain, feeding back its own proposals; a proposal is
  accepted while each equals the verifier's greedy token there, read from the stored last
  hidden states along the data's own continuation. Where the data's replies are not the
  verifier's own greedy ones this scores agreement with a path live decoding never takes
  (on SmolLM2 with the bundled replies: 1.9x what vLLM accepts), and from every position
  rather than where rounds start.
- ``greedy`` (`greedy_offline`): the verifier's own greedy continuation of prompts
  (`max_new_tokens` tokens as served, plus `depth` + 1 for the last rounds' verification,
  decoded past the stop token), made by the engine (transformers, or plain vLLM with no
  draft), its features extracted by the same engine, and rounds replayed as vLLM runs them
  (`eagle3x.evaluation.live.greedy_rounds`): the estimate of vLLM's served figure, exact
  for greedy decoding up to the engines' rounding. Greedy only: at a temperature above 0
  acceptance is measured in vLLM (`eagle3x.evaluation.served`).

Both report the mean accepted length (accepted drafts + the verifier's own token) and the
acceptance rate at each depth.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set, Tuple

from eagle3x import artifacts
from eagle3x.config.schema import EngineConfig, EngineName, ExtractConfig, OfflineEval
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")


def evaluate(draft: Any, head: Any, loader: Any, depth: int, max_samples: int) -> Dict[str, Any]:
    import torch

    from eagle3x.draft.ttt import chain_acceptance

    counts = torch.zeros(depth + 1, dtype=torch.long)  # positions with exactly j accepted
    seen = 0
    draft.eval()
    for batch in loader:
        res = chain_acceptance(draft, batch, head, depth)
        acc = res["accepted"][res["valid"]]
        counts += torch.bincount(acc, minlength=depth + 1)[: depth + 1]
        seen += int(batch["lengths"].numel())
        if seen >= max_samples:
            break
    total = int(counts.sum())
    reached = [int(counts[j:].sum()) for j in range(depth + 1)]  # accepted >= j
    rates = [reached[j + 1] / reached[j] if reached[j] else 0.0 for j in range(depth)]
    mean = float((counts * torch.arange(depth + 1)).sum()) / max(total, 1)
    return {"positions": total, "samples": seen, "depth": depth,
            "mean_accepted_length": 1.0 + mean, "acceptance_rate_per_depth": rates}


def held_out_prompts(plan: RunPlan, count: int) -> List[List[int]]:
    """The prompt of each held-out sample (its tokens before the first trained token: the
    chat-templated turns up to the assistant's header), the first `count` that have one."""
    from eagle3x.data import prepared
    from eagle3x.evaluation.live import first_trained

    data = prepared.load(plan.prepared.folder)
    off, ids, mask = data["offsets"], data["input_ids"], data["loss_mask"]
    prompts: List[List[int]] = []
    for i in range(min(plan.split.holdout, data["n"])):
        f = first_trained(mask[off[i]:off[i + 1]])
        if f is not None and f >= 2:
            prompts.append([int(x) for x in ids[off[i]:off[i] + f]])
        if len(prompts) == count:
            break
    return prompts


def stop_tokens(verifier: Path) -> Set[int]:
    """The tokens that end a served request: generation_config.json's eos ids and the
    tokenizer's eos token (vLLM stops at both)."""
    from eagle3x.engines.generate import stop_ids
    from eagle3x.verifier import load_tokenizer

    tok = load_tokenizer(verifier)
    stops = stop_ids(verifier, tok)
    if tok.eos_token_id is not None:
        stops.add(int(tok.eos_token_id))
    return stops


def served_length(path: Sequence[int], stops: Set[int], max_new_tokens: int) -> int:
    """How many tokens a greedy request for `max_new_tokens` returns when its continuation
    is `path`: up to and including the first stop token, else `max_new_tokens`."""
    for i, t in enumerate(path[:max_new_tokens]):
        if int(t) in stops:
            return i + 1
    return min(max_new_tokens, len(path))


def held_out(plan: RunPlan, count: int) -> List[List[int]]:
    """`held_out_prompts`, refusing a split with none."""
    prompts = held_out_prompts(plan, count)
    if not prompts:
        raise artifacts.ArtifactError(f"{plan.prepared.folder}: no held-out sample has a prompt "
                                      "before its first trained token (data.holdout_samples=0?)")
    return prompts


def _hf_greedy(eng: Any, head: Any, prompts: Sequence[Sequence[int]], length: int,
               batch: int = 16) -> List[List[int]]:
    """`length` greedy tokens after each prompt from a transformers engine's base model and
    the verifier's head (argmax: the family's logit scale and soft-cap keep it), past any
    stop token. `batch` prompts at a time through the generators' batched loop
    (`eagle3x.engines.generate.decode`: left-padded, KV cache reused)."""
    from eagle3x.engines.generate import Request, Sampling, decode

    def forward(ids, mask, pos, cache):
        res = eng.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
        return res.last_hidden_state[:, -1].float().cpu() @ head.T, res.past_key_values

    out: List[List[int]] = []
    for at in range(0, len(prompts), batch):
        group = [Request(k, p, length, 0) for k, p in enumerate(prompts[at:at + batch], at)]
        done, _ = decode(forward, group, Sampling(0.0, 1.0, length, 0), set(), eng.device)
        got = dict(done)
        out += [got[r.key].token_ids for r in group]
    return out


def greedy_paths(plan: RunPlan, engine: EngineConfig, extract: ExtractConfig,
                 prompts: Sequence[Sequence[int]], length: int, head: Any
                 ) -> Tuple[List[List[int]], List[Any]]:
    """The verifier's greedy continuation of each prompt (`length` tokens, decoded past the
    stop token) and the hidden states along prompt + continuation, both made by `engine`:
    transformers (one load does both), or plain vLLM (no draft) and then the vLLM extractor."""
    from eagle3x.engines.base import open_engine, vllm_options
    from eagle3x.evaluation.live import extract_all

    longest = max(map(len, prompts)) + length + 1
    if engine.name is EngineName.hf:
        eng = open_engine(engine, plan.verifier, plan.aux_layer_ids, longest, plan.run_dir)
        try:
            paths = _hf_greedy(eng, head, prompts, length)
            feats = extract_all(eng, [list(p) + q for p, q in zip(prompts, paths)],
                                extract.batch_size)
        finally:
            eng.close()
        return paths, feats
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3x.engines.generate import VLLMGenerator

    gen = VLLMGenerator(plan.verifier.path, vllm_options(engine, plan.verifier), longest, set())
    try:
        outs = gen.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True),
                                use_tqdm=False)
        paths = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        gen.close()
    eng = open_engine(engine, plan.verifier, plan.aux_layer_ids, longest, plan.run_dir)
    try:
        feats = extract_all(eng, [list(p) + q for p, q in zip(prompts, paths)], extract.batch_size)
    finally:
        eng.close()
    return paths, feats


def greedy_offline(plan: RunPlan, extract: ExtractConfig, engine: EngineConfig, draft: Any,
                   head: Any, depth: int, count: int, m: int) -> Dict[str, Any]:
    """`eval.offline=greedy`: the draft scored on the verifier's own greedy continuations of
    the first `count` held-out prompts (`m` new tokens), rounds replayed as vLLM runs them
    (the module docstring)."""
    import time

    prompts = held_out(plan, count)
    log.info("eval: the verifier's greedy continuations of %d held-out prompts (engine=%s, "
             "%d new tokens)", len(prompts), engine.name.value, m)
    t0 = time.perf_counter()
    paths, feats = greedy_paths(plan, engine, extract, prompts, m + depth + 1, head)
    stops = stop_tokens(plan.verifier.path)
    served = [served_length(q, stops, m) for q in paths]
    seqs = [list(p) + q for p, q in zip(prompts, paths)]
    from eagle3x.evaluation.live import replay

    out = replay(draft, head, prompts, seqs, served, feats, depth)
    out.pop("_rounds")
    out.update(prompts=len(prompts), max_new_tokens=m, depth=depth,
               mean_new_tokens=sum(served) / len(served), engine=engine.name.value,
               seconds=round(time.perf_counter() - t0, 1),
               _served=[q[:n] for q, n in zip(paths, served)])  # (dropped before writing)
    return out


#: eval.json's `measures_what`: what the offline figure scored, in words.
MEASURES = {
    OfflineEval.data: "the held-out samples' own replies, from every trained position "
                      "(an estimate: where those replies are not the verifier's own greedy "
                      "ones it overstates live decoding)",
    OfflineEval.greedy: "the verifier's greedy continuations of held-out prompts, rounds "
                        "replayed as vLLM runs them (estimates vLLM's served figure)",
}


