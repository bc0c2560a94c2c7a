"""Does vLLM serve a draft as trained when several requests are in flight?

The live eval holds vLLM's greedy acceptance against the exact offline replay of the same
paths (eagle3x.evaluation.live). When the two differ, this tells the draft from the engine:
one vLLM engine serves the held-out prompts in groups of each size given (1: one at a time),
and each group size's rounds and accepted tokens are printed beside the replay's. A draft
served as trained matches the replay at every size; a gap that appears only with several
requests in flight is the engine's batched drafting.

    python bench/batched_drafting.py --draft RUN/draft --depth 5 --groups 1,8,32 -- \\
        verifier=local verifier.path=... data=jsonl data.path=... data.holdout_samples=32

Everything after `--` is eagle3x overrides naming the run (verifier, data, engine): the
held-out prompts are those `stage=eval` serves. vLLM runs in float32, eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import List, Sequence


def main(argv: Sequence[str]) -> None:
    own, overrides = _split(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, required=True, help="exported draft folder")
    ap.add_argument("--depth", type=int, default=5, help="speculative tokens")
    ap.add_argument("--groups", default="1,32", help="requests served together, comma list")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vLLM's max_model_len (default: eagle3x's, evaluation.live.model_len)")
    args = ap.parse_args(own)

    from eagle3x.config.compose import load_config, typed
    from eagle3x.config.schema import EngineName
    from eagle3x.draft.save import load
    from eagle3x.engines.base import open_engine, vllm_options
    from eagle3x.evaluation.live import (ServedDraft, compare_rounds, extract_all, model_len,
                                         replay, served_counts)
    from eagle3x.evaluation.offline import held_out_prompts
    from eagle3x.plan import resolve
    from eagle3x.weights import EMBED_NAMES, find_tensor, verifier_head

    settings = typed(load_config(["stage=eval", "engine.dtype=float32",
                                  "engine.enforce_eager=true", *overrides]))
    plan = resolve(settings)
    depth, m = args.depth, args.max_new_tokens
    prompts = held_out_prompts(plan, args.prompts)
    longest = args.max_model_len or model_len(max(map(len, prompts)), m, depth)
    if longest < max(map(len, prompts)) + m + depth + 1:
        ap.error(f"--max-model-len {longest}: the longest prompt with {m + depth + 1} new "
                 f"tokens needs {max(map(len, prompts)) + m + depth + 1}")
    groups = [int(g) for g in args.groups.split(",")]

    served = ServedDraft(plan.verifier.path, args.draft, depth,
                         vllm_options(settings.engine, plan.verifier), longest, probe=False)
    rows: List[tuple] = []
    try:
        for g in groups:
            drafts = accepted = 0
            rounds: list = []
            made: list = []
            for i in range(0, len(prompts), g):
                before = served.counters()
                made += served.generate(prompts[i:i + g], m)
                c = served_counts(before, served.counters(), depth)
                drafts, accepted = drafts + c["drafts"], accepted + c["accepted_tokens"]
                rounds += served.rounds
            rows.append((g, drafts, accepted, rounds, made))
        paths = served.generate(prompts, m + depth + 1, ignore_eos=True)
    finally:
        served.close()

    seqs = [list(p) + q for p, q in zip(prompts, paths)]
    hf = dataclasses.replace(settings.engine, name=EngineName.hf, dtype="float32")
    eng = open_engine(hf, plan.verifier, plan.aux_layer_ids, longest, plan.run_dir)
    try:
        feats = extract_all(eng, seqs, settings.extract.batch_size)
    finally:
        eng.close()
    vpath = plan.verifier.path
    draft = load(args.draft, find_tensor(vpath, EMBED_NAMES).float())
    head = verifier_head(vpath, plan.verifier.tied_head).float()

    print(f"{args.draft}: depth {depth}, {len(prompts)} held-out prompts, {m} new tokens, "
          f"vLLM max_model_len {longest}")
    print(f"{'in flight':>9} | {'rounds':>6} {'accepted':>8} {'mean acc.':>9} | "
          f"{'as replayed':>11} | first departure")
    replays: dict = {}  # one replay per set of served lengths (greedy: the same for all)
    for g, drafts, accepted, rounds, made in rows:
        same_paths = all(p[:len(q)] == q for p, q in zip(paths, made))
        lengths = tuple(len(q) for q in made)
        if lengths not in replays:
            replays[lengths] = replay(draft, head, prompts, seqs, list(lengths), feats, depth)
        rep = replays[lengths]
        cmp = compare_rounds(rounds, rep["_rounds"], depth)
        d = cmp["departures"][0] if cmp["departures"] else None
        first = (f"prompt {d['prompt']}, round {d['round'] + 1}: vLLM [verified, accepted] "
                 f"{d['served']}, replay accepted {d['replayed_accepted']}") if d else "-"
        print(f"{g:>9} | {drafts:>6} {accepted:>8} {1 + accepted / max(drafts, 1):>9.3f} | "
              f"{cmp['same_rounds']:>4} of {cmp['requests']:<4} | {first}"
              + ("" if same_paths else "  (greedy paths differ!)"))
        if g == groups[0]:
            replayed = (rep["drafts"], rep["accepted_tokens"], rep["mean_accepted_length"])
    print(f"{'replay':>9} | {replayed[0]:>6} {replayed[1]:>8} {replayed[2]:>9.3f} |")


def _split(argv: Sequence[str]):
    """(this script's arguments, eagle3x's overrides after `--`)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


if __name__ == "__main__":
    main(sys.argv[1:])
