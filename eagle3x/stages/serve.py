"""Stage `serve`: a vLLM server that makes this verifier's hidden states for `hidden=server`.

    python -m eagle3x stage=serve serve.host=0.0.0.0 serve.port=8000 \\
        hidden.shared_dir=/shared/eagle3x-hidden [verifier, engine.*, extract.* as training]

Starts `vllm serve` with eagle3x's extraction hooks (eagle3x.engines.server.serve_argv),
waits until it answers (its start shown phase by phase, read from vLLM's log), writes its
card into `hidden.shared_dir` (what trainers check before they start), prints the URL,
and runs until stopped (Ctrl-C / SIGTERM stop the server and remove the card; status 0).
A server that dies on its own, starting or serving, ends the stage with one line naming
the cause from its log (`EngineFailed`; status 1).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from pathlib import Path

from eagle3x import console
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EngineConfig, ExtractConfig, HiddenConfig, ServeConfig
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")


def run(plan: RunPlan, serve: ServeConfig, engine: EngineConfig, extract: ExtractConfig,
        hidden: HiddenConfig) -> Outcome:
    import os
    import urllib.error

    from eagle3x.engines.errors import EngineFailed
    from eagle3x.engines.options import vllm_options
    from eagle3x.engines.watch import StartWatch
    from eagle3x.engines.server import (expected_card, get_json, new_served_name, serve_argv,
                                        write_card)
    from eagle3x.engines.vllm import engine_kwargs

    shared = Path(hidden.shared_dir)
    shared.mkdir(parents=True, exist_ok=True)
    kw = engine_kwargs(plan.verifier.path, plan.aux_layer_ids, plan.verifier.info.num_layers,
                       extract.max_seq_len, str(shared), vllm_options(engine, plan.verifier))
    name = new_served_name()
    argv = serve_argv(plan.verifier.path, kw, serve.host, serve.port, name)
    shown = "localhost" if serve.host in ("0.0.0.0", "::") else serve.host
    url = f"http://{shown}:{serve.port}"
    log.info("starting vLLM for %s on %s (captures into %s)", plan.verifier.path, url, shared)
    env = dict(os.environ)
    timeout = engine.rpc_timeout  # engine.rpc_timeout, as the server's vLLM reads it
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(timeout)
    watch = StartWatch("vllm")
    watch.__enter__()
    proc = subprocess.Popen(argv, env=env)
    card = None
    stop = {"signal": None}

    def handler(signum, _frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.perf_counter()
        while proc.poll() is None and stop["signal"] is None:
            try:
                get_json(url + "/v1/models", 2.0)
                break
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(1.0)
        watch.__exit__(None, None, None)
        if proc.poll() is not None:
            raise EngineFailed("vllm", "start", watch.offset, timeout) from RuntimeError(
                f"vLLM's server exited with status {proc.returncode} before answering")
        if stop["signal"] is None:
            card = write_card(shared, name, url, expected_card(
                plan.verifier.fingerprint, plan.aux_layer_ids, engine.dtype,
                extract.max_seq_len))
            phases = watch.summary()
            log.info("hidden-state server ready in %.0fs%s: %s (card %s); train with "
                     "hidden=server hidden.urls=[%s] hidden.shared_dir=%s",
                     time.perf_counter() - t0, f" ({phases})" if phases else "", url, card,
                     url, shared)
            print(url, file=console.stdout(), flush=True)
        while proc.poll() is None and stop["signal"] is None:
            time.sleep(0.5)
        if stop["signal"] is None:  # it ended on its own: it died
            raise EngineFailed("vllm", "serve", watch.offset, timeout) from RuntimeError(
                f"vLLM's server exited with status {proc.returncode}")
    finally:
        watch.__exit__(None, None, None)
        for s, h in old.items():
            signal.signal(s, h)
        if card is not None:
            card.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return Outcome("server", "stopped", shared)
