"""Stage `eval`: greedy acceptance of a draft on held-out samples, offline and (optionally) live.

The offline figure (`eval.offline`, eval.json's ``mean_accepted_length``; ``measures``
names what it scored):

- ``data``: from every trained position of the validation split the draft proposes
  `eval.depth` tokens in a chain, feeding back its own proposals; a proposal is accepted
  while each equals the verifier's greedy token there, read from the stored last hidden
  states along the data's own continuation. Where the data's replies are not the
  verifier's own greedy ones this scores agreement with a path live decoding never takes
  (on SmolLM2 with the bundled replies: 1.9x what vLLM accepts), and from every position
  rather than where rounds start.
- ``greedy``: the verifier's own greedy continuation of the first `eval.prompts` held-out
  prompts (`eval.max_new_tokens` tokens as served, plus `depth` + 1 for the last rounds'
  verification, decoded past the stop token), made by `engine` (transformers, or plain
  vLLM with no draft), its features extracted by the same engine, and rounds replayed as
  vLLM runs them (`eagle3x.draft.live.greedy_rounds`): the estimate of vLLM's served
  figure, exact for greedy decoding up to the engines' rounding. The data figure is kept
  under ``data``.

The result reports the mean accepted length (accepted drafts + the verifier's own token)
and the acceptance rate at each depth.

With `eval.live=true` the draft is also served by vLLM on the held-out prompts (``live``):
vLLM's own counters; the offline estimate that is exact for greedy decoding (features
extracted along vLLM's greedy continuation, rounds replayed as vLLM runs them); and the
parity of vLLM's draft with the trained one on the first prompt. Written to eval.json
under "live"; the figures also go to summary.json and W&B.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set, Tuple

from eagle3x import artifacts
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import (EngineConfig, EngineName, EvalConfig, ExtractConfig,
                                   HiddenConfig, HiddenSource, OfflineEval, TrainConfig)
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
    from eagle3x.draft.live import first_trained

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


def extract_all(eng: Any, seqs: Sequence[Sequence[int]], batch_size: int) -> List[Any]:
    """(aux, last) hidden states of each sequence, `batch_size` sequences per engine call."""
    feats: List[Any] = []
    for i in range(0, len(seqs), batch_size):
        feats += eng.extract(seqs[i:i + batch_size])
    return feats


def replay(draft: Any, head: Any, prompts: Sequence[Sequence[int]],
           seqs: Sequence[Sequence[int]], served: Sequence[int], feats: Sequence[Any],
           depth: int) -> Dict[str, Any]:
    """Greedy speculative decoding replayed on each prompt's greedy path `seqs` (prompt +
    continuation, `depth` + 1 tokens past what was served): the draft's chain acceptance
    from every position, rounds replayed as vLLM runs them for a request that returned
    `served` tokens. Also the mean over every position of the same paths, and how often
    the stored last hidden states' greedy token is the path's next token (1.0 when the
    features are those of the path's own engine)."""
    import torch

    from eagle3x.draft.live import greedy_rounds, summarise
    from eagle3x.draft.ttt import chain_acceptance, shift

    drafts = accepted = 0
    per_pos = [0] * depth
    agree = total = 0
    every: List[int] = []
    for prompt, seq, made, (aux, last) in zip(prompts, seqs, served, feats):
        ids = torch.tensor([list(seq)])
        batch = {"input_ids": ids, "aux_hidden": aux[None].float(), "last_hidden": last[None],
                 "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([len(seq)])}
        nxt = shift(ids, 1, -1)
        acc = chain_acceptance(draft, batch, head, depth, greedy=nxt)["accepted"][0]
        n = len(prompt)
        rounds = greedy_rounds(acc.tolist(), n - 1, made)
        drafts += rounds["num_drafts"]
        accepted += rounds["num_accepted_tokens"]
        for j, c in enumerate(rounds["accepted_per_pos"]):
            per_pos[j] += c
        every += (acc[n - 1:n - 2 + made] + 1).tolist()
        own = (last.float() @ head.T).argmax(-1)[n - 1:-1]
        agree += int((own == ids[0, n:]).sum())
        total += own.numel()
    out = summarise(drafts, accepted, per_pos, depth)
    out["all_positions_mean_accepted_length"] = sum(every) / max(len(every), 1)
    out["verifier_agreement"] = agree / max(total, 1)
    return out


def _prompts(plan: RunPlan, count: int) -> List[List[int]]:
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


def greedy_offline(plan: RunPlan, settings: EvalConfig, extract: ExtractConfig,
                   engine: EngineConfig, draft: Any, head: Any) -> Dict[str, Any]:
    """`eval.offline=greedy`: the draft scored on the verifier's own greedy continuations of
    held-out prompts, rounds replayed as vLLM runs them (the module docstring)."""
    import time

    depth, m = settings.depth, settings.max_new_tokens
    prompts = _prompts(plan, settings.prompts)
    log.info("eval: the verifier's greedy continuations of %d held-out prompts (engine=%s, "
             "%d new tokens)", len(prompts), engine.name.value, m)
    t0 = time.perf_counter()
    paths, feats = greedy_paths(plan, engine, extract, prompts, m + depth + 1, head)
    stops = stop_tokens(plan.verifier.path)
    served = [served_length(q, stops, m) for q in paths]
    seqs = [list(p) + q for p, q in zip(prompts, paths)]
    out = replay(draft, head, prompts, seqs, served, feats, depth)
    out.update(prompts=len(prompts), max_new_tokens=m, depth=depth,
               mean_new_tokens=sum(served) / len(served), engine=engine.name.value,
               seconds=round(time.perf_counter() - t0, 1),
               _served=[q[:n] for q, n in zip(paths, served)])  # (dropped before writing)
    return out


def live(plan: RunPlan, settings: EvalConfig, extract: ExtractConfig, engine: EngineConfig,
         draft_dir: Path, draft: Any, head: Any) -> Dict[str, Any]:
    """Serve the draft with vLLM on held-out prompts; compare with the exact offline replay."""
    from eagle3x.draft.live import ServedDraft, parity, served_counts
    from eagle3x.engines.base import open_engine, vllm_options

    depth, m = settings.depth, settings.max_new_tokens
    prompts = _prompts(plan, settings.prompts)
    longest = max(map(len, prompts)) + m + depth + 2
    options = vllm_options(engine, plan.verifier)
    log.info("eval: serving %s with vLLM on %d held-out prompts (%d new tokens, %d speculative)",
             draft_dir, len(prompts), m, depth)
    served = ServedDraft(plan.verifier.path, draft_dir, depth, options, longest)
    dtype = served.dtype
    try:
        before = served.counters()
        made = served.generate(prompts, m)  # as served: up to m tokens, ending at EOS
        counts = served_counts(before, served.counters(), depth)
        # The same greedy paths, long enough for the last rounds' verification.
        paths = served.generate(prompts, m + depth + 1, ignore_eos=True)
        record = served.record_first_steps(prompts[0], plan.run_dir / "parity.safetensors")
    finally:
        served.close()
    consistent = all(p[:len(q)] == q for p, q in zip(paths, made))

    seqs = [p + q for p, q in zip(prompts, paths)]
    eng = open_engine(engine, plan.verifier, plan.aux_layer_ids, longest, plan.run_dir)
    try:
        feats = extract_all(eng, seqs, extract.batch_size)
    finally:
        eng.close()
    offline = replay(draft, head, prompts, seqs, [len(q) for q in made], feats, depth)
    agreement = offline.pop("verifier_agreement")

    errors = parity(record, draft, feats[0][0], prompts[0], int(record["first"][0]))
    gap = (offline["mean_accepted_length"] / counts["mean_accepted_length"] - 1
           if counts["mean_accepted_length"] and offline["mean_accepted_length"] else None)
    return {"prompts": len(prompts), "max_new_tokens": m, "depth": depth,
            "mean_new_tokens": sum(map(len, made)) / len(made),
            "served": counts, "greedy_offline": offline, "offline_vs_served": gap,
            "speculative_paths_consistent": consistent,
            "verifier_agreement": agreement, "parity": errors,
            "parity_max_rel_error": max(v for k, v in errors.items() if k != "same_first_proposal"),
            "served_dtype": dtype, "_served": made}


def run(plan: RunPlan, eval: EvalConfig, train: TrainConfig, extract: ExtractConfig,
        engine: EngineConfig, hidden: HiddenConfig = HiddenConfig()) -> Outcome:
    from eagle3x.data.datamodule import HiddenStateDataModule
    from eagle3x.draft.save import load
    from eagle3x.weights import EMBED_NAMES, find_tensor, verifier_head

    out = plan.run_dir
    draft_dir = Path(eval.draft) if eval.draft else out / "draft"
    if not (draft_dir / "config.json").exists():
        raise artifacts.ArtifactError(f"{draft_dir}: no exported draft; train first or set eval.draft")
    vpath = plan.verifier.path
    draft = load(draft_dir, find_tensor(vpath, EMBED_NAMES).float())
    head = verifier_head(vpath, plan.verifier.tied_head).float()
    online = hidden.source is not HiddenSource.offline
    dm = HiddenStateDataModule.from_plan(plan, train, extract, engine if online else None,
                                         hidden if online else None)
    dm.setup()
    try:
        report = evaluate(draft, head, dm.val_dataloader(), eval.depth, eval.max_samples)
    finally:
        dm.close()  # the online engine, before vLLM serves the draft
    report["measures"] = OfflineEval.data.value
    report["measures_what"] = MEASURES[OfflineEval.data]
    out.mkdir(parents=True, exist_ok=True)
    if eval.offline is OfflineEval.greedy:
        data_figure = report
        report = greedy_offline(plan, eval, extract, engine, draft, head)
        report.update(measures=OfflineEval.greedy.value,
                      measures_what=MEASURES[OfflineEval.greedy], data=data_figure)
    report["draft"] = str(draft_dir)
    report["hidden"] = hidden.source.value
    mine = report.pop("_served", None)
    if eval.live:
        report["live"] = lv = live(plan, eval, extract, engine, draft_dir, draft, head)
        theirs = lv.pop("_served")
        if mine is not None and lv["served"]["mean_accepted_length"]:
            lv["offline_estimate_vs_served"] = (
                (report["mean_accepted_length"] or 0) / lv["served"]["mean_accepted_length"] - 1)
            # The greedy continuations the estimate scored, against those vLLM served.
            lv["offline_paths_same_as_served"] = (
                sum(a == b for a, b in zip(mine, theirs)) / max(len(theirs), 1))
    artifacts.write_json_atomic(out / "eval.json", report)
    wandb = sys.modules.get("wandb")  # the train stage of this run opened it, if any
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update(wandb_summary(report))
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_rate_per_depth"])
    if report["measures"] == OfflineEval.data.value:
        log.info("eval (offline, along the held-out data's replies): mean accepted length %.3f "
                 "over %d positions; acceptance per depth %s", report["mean_accepted_length"],
                 report["positions"], rates)
    else:
        log.info("eval (offline, the verifier's greedy continuations of %d held-out prompts, "
                 "rounds replayed as vLLM runs them): mean accepted length %.3f over %d rounds; "
                 "acceptance per depth %s; %.3f along the held-out data's replies",
                 report["prompts"], report["mean_accepted_length"] or 0, report["drafts"],
                 rates, report["data"]["mean_accepted_length"])
    if "live" in report:
        lv = report["live"]
        log.info("eval live (vLLM, %d prompts): mean accepted length %.3f served, %.3f exact "
                 "offline replay (%+.1f%%); %.3f from every position of the same paths; "
                 "parity with the trained draft: max relative error %.1e (vLLM in %s)",
                 lv["prompts"], lv["served"]["mean_accepted_length"] or 0,
                 lv["greedy_offline"]["mean_accepted_length"] or 0,
                 100 * (lv["offline_vs_served"] or 0),
                 lv["greedy_offline"]["all_positions_mean_accepted_length"],
                 lv["parity_max_rel_error"], lv["served_dtype"])
        if "offline_estimate_vs_served" in lv:
            log.info("eval: the offline estimate (greedy, engine=%s) is %+.1f%% of vLLM's served "
                     "figure; its greedy continuations are vLLM's on %.0f%% of the prompts",
                     report["engine"], 100 * lv["offline_estimate_vs_served"],
                     100 * lv["offline_paths_same_as_served"])
    return Outcome("eval", "wrote", out / "eval.json")


#: eval.json's `measures_what`: what the offline figure scored, in words.
MEASURES = {
    OfflineEval.data: "the held-out samples' own replies, from every trained position "
                      "(an estimate: where those replies are not the verifier's own greedy "
                      "ones it overstates live decoding)",
    OfflineEval.greedy: "the verifier's greedy continuations of held-out prompts, rounds "
                        "replayed as vLLM runs them (estimates vLLM's served figure)",
}


def wandb_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """The eval figures as W&B summary keys."""
    out = {"eval/mean_accepted_length": report["mean_accepted_length"],
           "eval/offline_measures": report.get("measures", OfflineEval.data.value),
           **{f"eval/accept_rate_{j}": r for j, r in enumerate(report["acceptance_rate_per_depth"])}}
    lv = report.get("live")
    if lv:
        out.update({"eval/live_mean_accepted_length": lv["served"]["mean_accepted_length"],
                    "eval/greedy_mean_accepted_length": lv["greedy_offline"]["mean_accepted_length"],
                    "eval/parity_max_rel_error": lv["parity_max_rel_error"],
                    **{f"eval/live_accept_rate_{j}": r for j, r in
                       enumerate(lv["served"]["acceptance_rate_per_depth"])}})
    return out
