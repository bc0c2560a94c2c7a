"""Evaluating a trained draft: the library under `stage=eval`.

    offline      acceptance without serving the draft: along the held-out data
                 (`evaluate`), or on the verifier's greedy continuations with rounds
                 replayed as vLLM runs them (`greedy_offline`)
    live         the draft served by vLLM (`ServedDraft`): its counters, the greedy round
                 replay, parity with the trained draft (`serve_and_compare`)
    probe        the vLLM worker extension that records what the served drafter computes
    vllm_check   `python -m eagle3x.evaluation.vllm_check`: greedy output with and without
                 the draft must be identical
    benchmarks   eval.benchmarks: the registry of prompt sets, their startup checks,
                 reading and rendering their prompts
    served       each set served by vLLM with and without the draft: acceptance per
                 temperature, greedy equality, the speedup per concurrency
    report       eval.json's figures on the console, in W&B and in compare's columns

Importing this package imports nothing heavy (vLLM's workers import `probe` through it).
"""
