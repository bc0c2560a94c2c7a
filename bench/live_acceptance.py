"""vLLM's live acceptance of a trained draft on held-out prompts.

    python bench/live_acceptance.py --draft RUN/draft [--k 3] [--prompts 32] [overrides ...]

The prompts are the first user turn (with any system turn before it) of the held-out
conversations: the first `data.holdout_samples` of the `data.seed` order, which no run on
this data trains on. Each is rendered with the verifier's chat template and a generation
prompt; vLLM decodes it greedily with and without the draft (`eagle3x.draft.vllm_check`).
Prints one json line on stdout (vLLM's log goes to stderr): identical outputs, vLLM's counters and the mean accepted length
(1 + accepted / drafts). The overrides are the run's (they locate verifier and data).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List


def held_out_prompts(overrides: List[str], count: int) -> tuple:
    import numpy as np
    from transformers import AutoTokenizer

    from eagle3x.config.compose import load_config
    from eagle3x.data.conversations import iter_conversations

    cfg = load_config(["stage=eval", *overrides])
    if cfg.verifier.tiny:
        from eagle3x import tiny

        tiny.build(cfg.verifier.path)
    convs = list(iter_conversations(cfg.data.path, cfg.data.format.value))
    order = np.random.default_rng(cfg.data.seed).permutation(len(convs))
    held = [convs[k] for k in order[: cfg.data.holdout_samples]]
    tok = AutoTokenizer.from_pretrained(str(cfg.verifier.path))
    prompts = []
    for conv in held[:count]:
        first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
        text = tok.apply_chat_template(conv.messages[:first], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    return str(cfg.verifier.path), prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--draft", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    known, overrides = p.parse_known_args()
    from eagle3x.draft.vllm_check import check, stdout_to_stderr

    with stdout_to_stderr():
        verifier, prompts = held_out_prompts(overrides, known.prompts)
        res = check(verifier, known.draft, prompts, k=known.k, max_tokens=known.max_tokens)
    out = {"prompts": len(prompts), "k": known.k, "identical": res["identical"],
           "mean_accepted_length": res["mean_accepted_length"], "counters": res["counters"]}
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
