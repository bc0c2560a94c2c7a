"""Serve an exported draft with vLLM beside its verifier and check it.

    python -m eagle3x.evaluation.vllm_check --verifier VERIFIER_DIR --draft DRAFT_DIR [--k 3]

Decodes the same prompts greedily with and without EAGLE-3 speculation, prints one json
object on stdout (and nothing else: vLLM's own log goes to stderr): whether the outputs are
identical (they must be: speculation never changes greedy output), and vLLM's own draft /
acceptance counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Dict, Iterator, List, Sequence


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (file descriptor 1, so vLLM's engine processes
    too) to stderr for the duration, so the caller's stdout carries only its result."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def check(verifier: str, draft: str, prompts: Sequence[List[int]], k: int = 3,
          max_tokens: int = 32, memory: float = 0.3, dtype: str = "float32") -> Dict[str, Any]:
    """Greedy outputs with and without the draft, and vLLM's speculation counters."""
    import gc
    from pathlib import Path

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3x.evaluation.live import ServedDraft, model_len, served_counts
    from eagle3x.engines.base import shutdown_llm

    longest = model_len(max(map(len, prompts)), max_tokens, k)
    base = LLM(model=verifier, dtype=dtype, max_model_len=longest, enforce_eager=True,
               gpu_memory_utilization=memory)
    outs = base.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                         SamplingParams(max_tokens=max_tokens, temperature=0.0),
                         use_tqdm=False)
    plain = [list(o.outputs[0].token_ids) for o in outs]
    shutdown_llm(base)
    del base
    gc.collect()
    served = ServedDraft(Path(verifier), Path(draft), k,
                         {"dtype": dtype, "gpu_memory_utilization": memory}, longest)
    try:
        before = served.counters()
        drafted = served.generate(prompts, max_tokens)
        after = served.counters()
    finally:
        served.close()
    counts = served_counts(before, after, k)
    return {"identical": plain == drafted, "plain": plain, "speculative": drafted,
            "counters": counts, "mean_accepted_length": counts["mean_accepted_length"]}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--verifier", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", help="jsonl of token-id lists; default: a few from the tokenizer")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--memory", type=float, default=0.3)
    args = p.parse_args(argv)
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [json.loads(line) for line in f if line.strip()]
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.verifier)
        questions = ["What is 12 plus 30?", "Spell the word garden backwards.",
                     "How many metres are in 3 kilometres?", "Can you explain what a batch is?"]
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True) for q in questions]
        prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    with stdout_to_stderr():
        result = check(args.verifier, args.draft, prompts, args.k, args.max_tokens, args.memory)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
