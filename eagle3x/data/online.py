"""Hidden states made while the draft trains (`hidden=online`): nothing is stored.

`OnlineFeatures` owns an engine (vLLM or transformers, opened in the calling thread, as
`stage=extract` opens it) and one worker thread that runs it. The datamodule's batch
sampler tells it which batches come next (`schedule`); the worker computes up to
`prefetch` batches ahead of the trainer, so the engine works while the draft trains, and
the bound caps the memory the waiting batches hold. `samples(indices)` returns a batch's
samples, computing them at once when they were not scheduled; the time the trainer spent
waiting is counted (`wait_s`).

Each sample is what `ShardReader` returns for the same sample of an offline store: the
engine's (aux, last) encoded in the run's storage format and dtype
(`eagle3x.data.compact.encode`, the function extraction writes with) and decoded back
(`compact.decode`, the function the reader reads with), with int32 ids and uint8 masks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("eagle3x")


class HiddenSourceError(RuntimeError):
    """The engine or servers making the hidden states failed; training stops with this
    message (the run's checkpoints stay, and train.resume=auto continues from them)."""


class OnlineFeatures:
    def __init__(self, prepared: Dict[str, Any], open_engine: Callable[[], Any],
                 fmt: Dict[str, Any], dtype: Any, head: Optional[Callable[[], tuple]] = None,
                 prefetch: int = 4):
        self.data, self.fmt, self.dtype, self.head = prepared, fmt, dtype, head
        self.prefetch = max(1, int(prefetch))
        t0 = time.perf_counter()
        self.engine = open_engine()
        self.load_s = time.perf_counter() - t0
        self.wait_s = 0.0  # the trainer waiting for batches
        self.compute_s = 0.0  # the engine computing them
        self.batches = 0
        self.made = 0  # samples the engine computed (each once, when nothing is wasted)
        self._lock = threading.Condition()
        self._queue: "OrderedDict[Tuple[int, ...], None]" = OrderedDict()
        self._done: Dict[Tuple[int, ...], Any] = {}
        self._making: Optional[Tuple[int, ...]] = None  # the batch the worker computes now
        self._stop = False
        self._error: Optional[BaseException] = None
        self._worker = threading.Thread(target=self._run, name="eagle3x-online", daemon=True)
        self._worker.start()

    def length(self, i: int) -> int:
        offs = self.data["offsets"]
        return int(offs[i + 1]) - int(offs[i])

    def schedule(self, batches: Sequence[Sequence[int]]) -> None:
        """Compute these batches next, the first being the one the trainer takes next.
        At most that one and `prefetch` more are held (waiting, being made or made); the
        rest is dropped: the sampler asks again as the trainer moves on."""
        with self._lock:
            for b in batches:
                key = tuple(int(i) for i in b)
                if key in self._done or key in self._queue or key == self._making:
                    continue
                held = len(self._queue) + len(self._done) + (self._making is not None)
                if held >= self.prefetch + 1:
                    break
                self._queue[key] = None
            self._lock.notify_all()

    def samples(self, indices: Sequence[int]) -> List[Dict[str, Any]]:
        """Batch `indices` as training reads it, waiting for the worker if needed."""
        key = tuple(int(i) for i in indices)
        t0 = time.perf_counter()
        with self._lock:
            if key not in self._done and key not in self._queue and key != self._making:
                self._queue[key] = None
                self._queue.move_to_end(key, last=False)  # the trainer needs it now
                self._lock.notify_all()
            while key not in self._done and self._error is None:
                self._lock.wait(timeout=1.0)
            if self._error is not None:
                raise HiddenSourceError(f"online hidden states: {self._error}") \
                    from self._error
            out = self._done.pop(key)
            self._lock.notify_all()
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        return out

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                key, _ = self._queue.popitem(last=False)
                self._making = key
            try:
                t0 = time.perf_counter()
                made = self._make(key)
                self.compute_s += time.perf_counter() - t0
            except BaseException as exc:  # handed to the trainer's thread
                log.debug("online hidden states: the engine failed", exc_info=True)
                with self._lock:
                    self._making = None
                    self._error = exc
                    self._lock.notify_all()
                return
            with self._lock:
                self._done[key] = made
                self._making = None
                self._lock.notify_all()

    def _make(self, indices: Tuple[int, ...]) -> List[Dict[str, Any]]:
        import torch

        from eagle3x.data.compact import decode, encode

        offs, ids_all, mask_all = self.data["offsets"], self.data["input_ids"], self.data["loss_mask"]
        spans = [(int(offs[i]), int(offs[i + 1])) for i in indices]
        ids = [ids_all[a:b] for a, b in spans]
        outs = self.engine.extract([x.tolist() for x in ids])
        self.made += len(ids)
        head, softcap, scale = self.head() if self.head is not None else (None, None, 1.0)
        made = []
        for x, (a, b), (aux, last) in zip(ids, spans, outs):
            s = decode(encode(aux, last, self.fmt, self.dtype, head, softcap, scale))
            s["input_ids"] = torch.as_tensor(x, dtype=torch.int32)
            s["loss_mask"] = torch.as_tensor(mask_all[a:b], dtype=torch.uint8)
            made.append(s)
        return made

    def stats(self) -> Dict[str, float]:
        return {"engine_load_s": self.load_s, "wait_s": self.wait_s,
                "compute_s": self.compute_s, "batches": self.batches, "made": self.made}

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._worker.join(timeout=60)
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
