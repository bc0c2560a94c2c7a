"""Watching an engine through its own log: the phase of its start, and why it died.

vLLM's engine processes write their log to the job's log file (``eagle3x.console.quiet``
points their descriptors there), so the main process can read what they do without
bringing their lines back to the console:

``StartWatch`` (a context manager around an engine's construction; silent when the
libraries' output is not redirected, as with ``log.libraries=true``) reads the lines the
engine adds to the log, names the phase it is in (vLLM 0.32's own messages, listed in
``VLLM_PHASES`` with the file that logs each) and shows it with the elapsed time: one
status line rewritten in place on a terminal; elsewhere, once the start has lasted a few
seconds, a line at each new phase and one every `every` seconds while a phase lasts. It records how long each phase took
(``summary()``). transformers has no log to read: its start is one phase.

``cause(text, exc)`` reads an engine's death from the same log (and the exception the
main process got, which for vLLM says only "EngineCore encountered an issue"): an RPC
timeout, a worker or engine process that died and its exit code, out of memory, a CUDA
error; otherwise the last error line, or the exception's own message.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import List, Optional, Sequence, Tuple

from eagle3x import console
from eagle3x.failures import exit_code_meaning

log = logging.getLogger("eagle3x")

EAGER_HINT = "engine.enforce_eager=true skips it"
COMPILING = f"compiling the model with torch.compile ({EAGER_HINT})"
#: (pattern in a vLLM log line, the phase that line starts), in the order vLLM logs them.
VLLM_PHASES: Tuple[Tuple[str, str], ...] = (
    # vllm/v1/engine/core.py, EngineCore.__init__
    (r"Initializing a V1 LLM engine", "starting the engine processes"),
    # vllm/v1/worker/{cpu,gpu}_model_runner.py, load_model
    (r"Starting to load model", "loading the weights"),
    # vllm/compilation/backends.py (Dynamo, Inductor); vllm/v1/worker/cpu_model_runner.py
    (r"Warming up model for the compilation|Dynamo bytecode transform|Compiling a graph for",
     COMPILING),
    # vllm/compilation/backends.py, decorators.py: a compiled model from vLLM's cache
    (r"Directly load (?:the compiled graph|AOT compilation)",
     "loading the compiled model from vLLM's cache"),
    # vllm/v1/worker/gpu_model_runner.py, capture_model
    (r"Capturing CUDA graphs", f"capturing CUDA graphs ({EAGER_HINT})"),
    # vllm/v1/worker/cpu_worker.py, vllm/v1/core/kv_cache_utils.py
    (r"for KV cache on node|KV cache size:|Available KV cache memory",
     "allocating the KV cache and warming up"),
    # vllm/v1/engine/core.py, _initialize_kv_caches: the engine is ready
    (r"init engine \(profile, create kv cache, warmup model\) took", "ready"),
    # vllm/entrypoints/openai/api_server.py (stage=serve)
    (r"Starting vLLM API server|Available routes are", "starting the HTTP server"),
)
HF_LOADING = "loading the verifier's weights with transformers"


class StartWatch:
    """Shows an engine's start phase and elapsed time while the block runs.

    Reads the job's log file from where it ends at entry (nothing to read when the
    libraries' output is not redirected: then the console shows their own lines)."""

    def __init__(self, name: str, phases: Sequence[Tuple[str, str]] = VLLM_PHASES,
                 first: str = "starting the engine processes", every: float = 60.0,
                 poll: float = 0.5, quiet: float = 5.0):
        self.name, self.phases, self.every, self.poll = name, list(phases), every, poll
        self.quiet = quiet
        self._spoken = False
        self.phase = first
        self.history: List[Tuple[str, float]] = []  # (phase, seconds it took)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._terminal = console.is_terminal()
        self._drawn = False

    def __enter__(self) -> "StartWatch":
        self.t0 = self._since = self._said = time.perf_counter()
        #: where the engine's lines begin in the job's log (EngineFailed reads from here)
        self.offset = self._pos = console.log_size()
        self._rest = b""
        if console.log_file() is None:  # the libraries speak on the console themselves
            return self
        self._announce(self.phase)
        self._thread = threading.Thread(target=self._run, name="eagle3x-engine-start",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._read()
        now = time.perf_counter()
        self.history.append((self.phase, now - self._since))
        self.seconds = now - self.t0
        if self._drawn:  # leave the terminal line clean for what follows
            self._write("\r\x1b[2K")

    def summary(self) -> str:
        """"loading the weights 2.0s, compiling ... 41.3s" (phases over a second)."""
        merged: dict = {}
        for phase, took in self.history:
            if phase != "ready":
                merged[phase.split(" (")[0]] = merged.get(phase.split(" (")[0], 0.0) + took
        return ", ".join(f"{p} {t:.1f}s" for p, t in merged.items() if t >= 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self._read()
            now = time.perf_counter()
            if self._terminal:
                self._draw(now)
            elif not self._spoken and now - self.t0 >= self.quiet:
                self._announce(self.phase)
            elif self._spoken and now - self._said >= self.every:
                self._said = now
                log.info("engine %s: still %s (%s)", self.name, self.phase,
                         console.duration(now - self.t0))

    def _read(self) -> None:
        path = console.log_file()
        if not self.phases or path is None:
            return
        try:
            with open(path, "rb") as f:
                f.seek(self._pos)
                data = f.read(1 << 22)
        except OSError:
            return
        self._pos += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()[-4096:]
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            for pattern, phase in self.phases:
                if phase != self.phase and re.search(pattern, line):
                    self._enter(phase)
                    break

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.history.append((self.phase, now - self._since))
        self.phase, self._since = phase, now
        if phase != "ready":
            self._announce(phase)

    def _announce(self, phase: str) -> None:
        """The job log gets every phase; the console a status line on a terminal, else a
        line per phase once the start has lasted `quiet` seconds (a start of a second
        or two says nothing but "ready")."""
        now = time.perf_counter()
        if self._terminal:
            log.info("engine %s: %s", self.name, phase, extra=console.LOG_ONLY)
            self._draw(now)
        elif now - self.t0 >= self.quiet:
            self._said, self._spoken = now, True
            log.info("engine %s: %s (%s)", self.name, phase, console.duration(now - self.t0))
        else:
            log.info("engine %s: %s", self.name, phase, extra=console.LOG_ONLY)

    def _draw(self, now: float) -> None:
        self._drawn = True
        self._write(f"\r\x1b[2Kengine {self.name}: {self.phase} · "
                    f"{console.duration(now - self.t0)}")

    @staticmethod
    def _write(text: str) -> None:
        try:
            out = console.stream()
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass


#: (pattern in the engine's log or the exception chain, what it means), first match wins;
#: each names the vLLM source that writes it.
_CAUSES: Tuple[Tuple[str, str], ...] = (
    # vllm/v1/executor/multiproc_executor.py, collective_rpc
    (r"RPC call to (\w+) timed out",
     "vLLM's worker did not answer `{0}` within engine.rpc_timeout={timeout}s "
     "(RPC timeout; a first large batch on a slow machine can take longer: raise "
     "engine.rpc_timeout)"),
    # torch.OutOfMemoryError, CUDA or host allocators
    (r"(CUDA out of memory[^\n]{0,160}|OutOfMemoryError[^\n]{0,160}|"
     r"[Cc]annot allocate memory[^\n]{0,80}|can't allocate memory[^\n]{0,120}|"
     r"std::bad_alloc|MemoryError)",
     "out of memory ({0})"),
    (r"(CUDA error: [^\n]{0,200}|NCCL error[^\n]{0,200}|cudaError\w*[^\n]{0,120})",
     "{0}"),
    # vllm/v1/executor/multiproc_executor.py, start_worker_monitor
    (r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+|None)\)",
     "vLLM's worker process {0} died{exit}"),
    # vllm/v1/engine/utils.py / core_client.py, the engine core monitor
    (r"Engine core proc(?:ess)? (\S+) died unexpectedly",
     "vLLM's engine process {0} died"),
    # eagle3x/engines/lifeline.py: a process gone while the main process waited for it
    (r"vLLM's process (\S+) \(pid \d+\) died", "vLLM's process {0} died"),
)


def cause(text: str, exc: Optional[BaseException] = None, rpc_timeout: Optional[int] = None) -> str:
    """Why an engine stopped, from its log `text` (what it wrote since it started) and the
    exception the main process got."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    for where in (text, "\n".join(chain)):
        for pattern, meaning in _CAUSES:
            found = list(re.finditer(pattern, where))
            if found:
                m = found[-1]
                groups = [g for g in m.groups() if g is not None] or [m.group(0)]
                extra = {"timeout": rpc_timeout if rpc_timeout is not None else "?"}
                if "{exit}" in meaning:
                    code = m.group(2)
                    extra["exit"] = (f" ({exit_code_meaning(int(code))})" if code != "None"
                                     else " (its exit status was not known yet)")
                return meaning.format(*[g.strip() for g in groups], **extra)
    lines = [x.strip() for x in text.splitlines()
             if re.search(r"\b(Error|Exception)\b|ERROR", x) and "Traceback" not in x]
    if lines:
        return "the engine logged: " + lines[-1][-300:]
    return chain[0][:300] if chain else "unknown (see the job's log)"
