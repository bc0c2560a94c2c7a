"""Hidden-state extraction: run the verifier over prepared samples, store shards.

The one extraction loop, used by ``stage=extract`` and by the datamodule's
``prepare_data()``. Resumable and incremental: the manifest lists whole shards; a rerun
continues after the last one, and asking for more samples extracts only the missing ones.
A shard that fails its check (size, or sha256 with ``extract.verify=sha256``) is
re-extracted in place. SIGINT/SIGTERM write the samples done so far as a last whole shard,
then stop. The engine is opened only when there is something to extract.
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from eagle3x import artifacts, console
from eagle3x.artifacts import Outcome
from eagle3x.config.schema import EngineConfig, ExtractConfig, VerifyMode
from eagle3x.data import prepared, shards
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")


def header(plan: RunPlan) -> Dict[str, Any]:
    """What a hidden-state manifest records about its inputs."""
    return {"verifier": {"path": str(plan.verifier.path), "fingerprint": plan.verifier.fingerprint},
            "aux_layer_ids": list(plan.aux_layer_ids), "hidden_size": plan.verifier.info.hidden_size,
            "num_layers": plan.verifier.info.num_layers, "dtype": plan.hidden_dtype,
            "prepared": {"path": str(plan.prepared.folder),
                         "fingerprint": artifacts.read_manifest(plan.prepared.folder)["fingerprint"]}}


@contextmanager
def _stop_requests() -> Iterator[Dict[str, Optional[int]]]:
    """Turn SIGINT/SIGTERM into a flag the loop checks between batches."""
    state: Dict[str, Optional[int]] = {"signal": None}

    def handler(signum, _frame):
        state["signal"] = signum
        log.warning("signal %d: finishing the current batch, then writing a last whole shard", signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another eagle3x process is extracting into %s; waiting for it", folder)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def open_manifest(plan: RunPlan) -> Dict[str, Any]:
    """The folder's manifest (created if new), checked against this plan, orphans adopted."""
    out, fp = plan.hidden.folder, plan.hidden.fingerprint
    out.mkdir(parents=True, exist_ok=True)
    if (out / artifacts.MANIFEST).exists():
        m = artifacts.read_manifest(out)
        if m.get("fingerprint") != fp:
            raise artifacts.ArtifactError(
                f"{out / artifacts.MANIFEST}: these shards come from another verifier, aux "
                f"layers, dtype or prepared data (fingerprint {m.get('fingerprint')}, this run "
                f"{fp}); refusing to mix them. Choose another extract.output_dir.")
    else:
        m = artifacts.new_manifest("hidden", plan.config, fp, shards=[], samples=0,
                                   **header(plan))
        m["complete"] = True  # a hidden-state manifest always describes whole shards
        artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
    adopted = shards.adopt_orphans(out, m)
    if adopted:
        log.info("adopting %d shard(s) written before an interruption", len(adopted))
        m["shards"] += adopted
        m["samples"] += sum(a["num_samples"] for a in adopted)
        artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
    return m


class _Writer:
    """Collects extracted samples and writes whole shards of about `shard_tokens`."""

    def __init__(self, folder: Path, fingerprint: str, manifest: Dict[str, Any], dtype: Any,
                 shard_tokens: int):
        self.folder, self.fingerprint, self.m, self.dtype = folder, fingerprint, manifest, dtype
        self.shard_tokens = shard_tokens
        self.buf: List[tuple] = []
        self.tokens = 0

    def hold(self, ids: Any, mask: Any, aux: Any, last: Any) -> None:
        """Buffer one sample; it is written by the next flush."""
        self.buf.append((ids, mask, aux.to(self.dtype), last.to(self.dtype)))
        self.tokens += len(ids)

    def add(self, ids: Any, mask: Any, aux: Any, last: Any) -> None:
        """Buffer one sample, writing a shard once about `shard_tokens` are held."""
        self.hold(ids, mask, aux, last)
        if self.tokens >= self.shard_tokens:
            self.flush()

    def flush(self, index: Optional[int] = None, first: Optional[int] = None) -> Optional[Dict[str, Any]]:
        import torch

        if not self.buf:
            return None
        lengths = [len(b[0]) for b in self.buf]
        tensors = {
            "input_ids": torch.cat([torch.as_tensor(b[0], dtype=torch.int32) for b in self.buf]),
            "loss_mask": torch.cat([torch.as_tensor(b[1], dtype=torch.uint8) for b in self.buf]),
            "aux_hidden": torch.cat([b[2] for b in self.buf]),
            "last_hidden": torch.cat([b[3] for b in self.buf]),
            "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        }
        replacing = index is not None
        index = len(self.m["shards"]) if index is None else index
        first = self.m["samples"] if first is None else first
        entry = shards.write_shard(self.folder, index, tensors, first, self.fingerprint)
        if replacing:
            self.m["shards"][index] = entry
        else:
            self.m["shards"].append(entry)
            self.m["samples"] += entry["num_samples"]
        artifacts.write_json_atomic(self.folder / artifacts.MANIFEST, self.m)
        self.buf, self.tokens = [], 0
        return entry


def _samples(data: Dict[str, Any], start: int, end: int) -> Iterator[tuple]:
    offs = data["offsets"]
    for k in range(start, end):
        a, b = int(offs[k]), int(offs[k + 1])
        yield k, data["input_ids"][a:b], data["loss_mask"][a:b]


def _extracted(engine: Any, samples: List[tuple], batch_size: int) -> Iterator[List[tuple]]:
    """Run `samples` through the engine in batches; yield each batch's (ids, mask, aux, last)."""
    for b in range(0, len(samples), batch_size):
        batch = samples[b:b + batch_size]
        outs = engine.extract([ids.tolist() for _, ids, _ in batch])
        yield [(ids, mask, aux, last) for (_, ids, mask), (aux, last) in zip(batch, outs)]


def extract(plan: RunPlan, settings: ExtractConfig, engine_name: str,
            open_engine: Callable[[], Any]) -> Outcome:
    """Make sure ``plan.hidden.folder`` holds the hidden states of every sample the plan
    needs, extracting the missing ones with the engine `open_engine()` returns (opened only
    when there is work; `engine_name` is what the log and the manifest call it)."""
    from tqdm import tqdm

    from eagle3x.weights import torch_dtype

    out = plan.hidden.folder
    data = prepared.load(plan.prepared.folder)
    target = plan.split.extract_until(data["n"])
    dtype = torch_dtype(settings.dtype.value)
    with _exclusive(out):
        m = open_manifest(plan)
        bad = [i for i, e in enumerate(m["shards"])
               if artifacts.check_entry(out, e, full=settings.verify is VerifyMode.sha256)]
        if m["samples"] >= target and not bad:
            log.info("reusing hidden states at %s: %d samples in %d shards (%d asked for)",
                     out, m["samples"], len(m["shards"]), target)
            return Outcome("hidden", "reused", out)
        t0 = time.perf_counter()
        done_before, shards_before = m["samples"], len(m["shards"])
        log.info("extracting samples %d..%d with engine=%s into %s", done_before, target - 1,
                 engine_name, out)
        engine = open_engine()
        load_s = time.perf_counter() - t0
        log.info("engine %s ready in %.1fs", engine_name, load_s)
        t0 = time.perf_counter()
        new_tokens = 0
        try:
            writer = _Writer(out, plan.hidden.fingerprint, m, dtype, settings.shard_tokens)
            for i in bad:
                e = m["shards"][i]
                log.warning("re-extracting %s (failed its check)", e["name"])
                todo = list(_samples(data, e["first_sample"], e["first_sample"] + e["num_samples"]))
                for done in _extracted(engine, todo, settings.batch_size):
                    for sample in done:
                        writer.hold(*sample)
                writer.flush(index=i, first=e["first_sample"])
            bar = tqdm(total=target, initial=m["samples"], desc="extract", unit="sample",
                       dynamic_ncols=True, file=console.stream(),
                       mininterval=0.5 if console.is_terminal() else 10)
            with _stop_requests() as stop:
                pending = list(_samples(data, m["samples"], target))
                for done in _extracted(engine, pending, settings.batch_size):
                    for sample in done:
                        writer.add(*sample)
                        new_tokens += len(sample[0])
                    bar.update(len(done))
                    bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
                    if stop["signal"] is not None:
                        writer.flush()
                        bar.close()
                        log.warning("stopped by signal after %d samples; rerun to continue",
                                    m["samples"])
                        raise SystemExit(128 + stop["signal"])
                writer.flush()
            bar.close()
        finally:
            engine.close()
    wall = time.perf_counter() - t0
    m.setdefault("runs", []).append({
        "engine": engine_name, "samples": m["samples"] - done_before,
        "tokens": new_tokens, "seconds": round(wall, 3), "engine_start_seconds": round(load_s, 3),
        "tokens_per_second": round(new_tokens / max(wall, 1e-9), 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
    total_tokens = sum(s["tokens"] for s in m["shards"])
    total_bytes = sum(s["bytes"] for s in m["shards"])
    log.info("extracted %d new samples (%d tokens, %.0f tok/s) in %.1fs (+%.1fs engine start); folder holds %d samples, "
             "%d tokens, %d shards (+%d), %.0f bytes/token -> %s", m["samples"] - done_before,
             new_tokens, new_tokens / max(wall, 1e-9), wall, load_s, m["samples"], total_tokens,
             len(m["shards"]), len(m["shards"]) - shards_before,
             total_bytes / max(total_tokens, 1), out)
    return Outcome("hidden", "built", out)


@dataclass(frozen=True)
class HiddenStates:
    """How to make the hidden states a plan needs: prepare the data if missing, then
    extract with the configured engine. ``stage=extract`` opens its engine through it; a
    datamodule handed one (``HiddenStateDataModule.from_plan(..., engine)``, for library
    callers and the tests) runs ``make()`` in ``prepare_data()``. ``stage=train`` instead
    runs the prepare and extract stages before it (pipeline.STAGES)."""

    plan: RunPlan
    extract: ExtractConfig
    engine: EngineConfig

    def open_engine(self) -> Any:
        from eagle3x.engines.base import open_engine

        return open_engine(self.engine, self.plan.verifier, self.plan.aux_layer_ids,
                           self.extract.max_seq_len, self.plan.hidden.folder)

    def make(self, prepare: bool = True) -> List[Outcome]:
        """Build what is missing (prepared data only when `prepare`); return what was done."""
        from eagle3x.verifier import ensure

        ensure(self.plan.verifier.path, self.plan.verifier.tiny)
        done = [prepared.build(self.plan)] if prepare else []
        done.append(extract(self.plan, self.extract, self.engine.name.value, self.open_engine))
        return done
