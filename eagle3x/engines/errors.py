"""An engine's failure, as every caller catches it: `EngineFailed`, and `failing_as`,
which turns any error of an engine's block into one.

Torch-free and light (only the standard library at import): the pipeline's stop report,
the serve stage and the tests catch `EngineFailed` without importing torch or vLLM.
`EngineFailed.cause()` reads the engine's own lines from the job's log
(`engines.watch.cause`); `failing_as` puts a vLLM block on a `lifeline`, so a dead engine
process ends the wait.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


class EngineFailed(RuntimeError):
    """An engine (vLLM or transformers) failed while starting or working.

    `engine` names it ("vllm", "hf"), `during` what it was doing ("start", "extract",
    "generate", "serve"); `offset` is where its lines begin in the job's log, which
    `cause()` reads (call it once the engine is shut down: its processes write their
    traceback as they die)."""

    def __init__(self, engine: str, during: str, offset: int, rpc_timeout: Optional[int] = None):
        super().__init__(f"engine {engine} failed during {during}")
        self.engine, self.during, self.offset, self.rpc_timeout = engine, during, offset, rpc_timeout

    def cause(self) -> str:
        from eagle3x import console
        from eagle3x.engines.watch import cause

        return cause(console.log_since(self.offset), self.__cause__, self.rpc_timeout)


@contextlib.contextmanager
def failing_as(engine: str, during: str, offset: int,
               rpc_timeout: Optional[int] = None) -> Iterator[None]:
    """Any error of the engine in the block becomes `EngineFailed` (the original as its
    __cause__); KeyboardInterrupt and SystemExit pass. A vLLM block runs on a `lifeline`:
    were an engine process to die while it waits, the wait ends (`EngineDied`)."""
    from eagle3x.engines.lifeline import lifeline

    try:
        with (lifeline() if engine == "vllm" else contextlib.nullcontext()):
            yield
    except EngineFailed:
        raise
    except Exception as exc:
        raise EngineFailed(engine, during, offset, rpc_timeout) from exc
