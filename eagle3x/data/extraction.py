"""Hidden-state extraction: run the verifier over prepared samples, store shards.

The one extraction loop, used by ``stage=extract`` and by the datamodule's
``prepare_data()``. Resumable and incremental: the manifest lists whole shards; a rerun
continues after the last one, and asking for more samples extracts only the missing ones.
A shard that fails its check (size, or sha256 with ``extract.verify=sha256``) is
re-extracted in place. SIGINT/SIGTERM, and an engine that fails, write the samples done so
far as a last whole shard, then stop (``failures.Stopped`` with status 128 + the signal, or
the engine's ``EngineFailed``). The engine is opened only when there is something to extract.
"""

from __future__ import annotations

import json
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
            "format": plan.hidden_format,
            "prepared": {"path": str(plan.prepared.folder),
                         "fingerprint": artifacts.read_manifest(plan.prepared.folder)["fingerprint"]}}


@contextmanager
def stop_requests(doing: str = "finishing the current batch, then writing a last whole "
                               "shard") -> Iterator[Dict[str, Optional[int]]]:
    """Turn SIGINT/SIGTERM into a flag the loop checks between batches (`doing`: what
    happens before it stops, for the console)."""
    state: Dict[str, Optional[int]] = {"signal": None}

    def handler(signum, _frame):
        from eagle3x.failures import signal_name

        state["signal"] = signum
        log.warning("%s: %s", signal_name(signum), doing)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def _exclusive(folder: Path, holder: str) -> Iterator[None]:
    """`folder`'s lock (a file beside it); waits, saying so, while `holder` has it."""
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("%s (%s); waiting for it", holder, folder)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _held(folder: Path) -> bool:
    """Whether another process holds `folder`'s lock (`_exclusive`) right now."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


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
    """Collects extracted samples and writes whole shards of about `shard_tokens`, each
    sample encoded in the folder's storage format (``compact.encode``)."""

    def __init__(self, folder: Path, fingerprint: str, manifest: Dict[str, Any], dtype: Any,
                 shard_tokens: int, fmt: Dict[str, Any], head: Any = None):
        self.folder, self.fingerprint, self.m, self.dtype = folder, fingerprint, manifest, dtype
        self.shard_tokens, self.fmt, self.head = shard_tokens, fmt, head
        self.base = manifest.get("first_sample", 0)  # a part's first sample
        self.buf: List[tuple] = []
        self.tokens = 0

    def hold(self, ids: Any, mask: Any, aux: Any, last: Any) -> None:
        """Buffer one sample; it is written by the next flush."""
        from eagle3x.data.compact import encode

        head, softcap, scale = self.head.get() if self.head is not None else (None, None, 1.0)
        self.buf.append((ids, mask, encode(aux, last, self.fmt, self.dtype, head, softcap,
                                           scale)))
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
            "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        }
        for key in self.buf[0][2]:
            tensors[key] = torch.cat([b[2][key] for b in self.buf])
        replacing = index is not None
        index = len(self.m["shards"]) if index is None else index
        first = self.base + self.m["samples"] if first is None else first
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


class _Engine:
    """The engine, opened at the first call of `get()` (only when there is work)."""

    def __init__(self, open_engine: Callable[[], Any], name: str):
        self.open, self.name, self.engine, self.load_s = open_engine, name, None, 0.0

    def get(self) -> Any:
        if self.engine is None:
            t0 = time.perf_counter()
            self.engine = self.open()
            self.load_s = time.perf_counter() - t0
            phases = getattr(self.engine, "started", "")
            log.info("engine %s ready in %.1fs%s", self.name, self.load_s,
                     f" ({phases})" if phases else "")
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _bad_shards(folder: Path, m: Dict[str, Any], verify: VerifyMode) -> List[int]:
    return [i for i, e in enumerate(m["shards"])
            if artifacts.check_entry(folder, e, full=verify is VerifyMode.sha256)]


def _fill(folder: Path, m: Dict[str, Any], end: int, bad: List[int], data: Dict[str, Any],
          engine: _Engine, writer: "_Writer", settings: ExtractConfig, desc: str) -> int:
    """Re-extract the shards `bad` of the folder with manifest `m`, then extract its
    samples up to `end` (absolute index); return the new tokens. SIGINT/SIGTERM, or an
    engine that fails: the samples done are written as a last whole shard, then
    `failures.Stopped` (signals) or the engine's error is raised."""
    from eagle3x.failures import Stopped, signal_exit, signal_name

    base = m.get("first_sample", 0)
    for i in bad:
        e = m["shards"][i]
        log.warning("re-extracting %s (failed its check) in %s", e["name"], folder)
        todo = list(_samples(data, e["first_sample"], e["first_sample"] + e["num_samples"]))
        for done in _extracted(engine.get(), todo, settings.batch_size):
            for sample in done:
                writer.hold(*sample)
        writer.flush(index=i, first=e["first_sample"])
    if base + m["samples"] >= end:
        return 0
    pending = list(_samples(data, base + m["samples"], end))
    eng = engine.get()
    t0, new_tokens = time.perf_counter(), 0
    bar = console.progress(end - base, desc, "samples", initial=m["samples"])
    with stop_requests() as stop:
        try:
            for done in _extracted(eng, pending, settings.batch_size):
                for sample in done:
                    writer.add(*sample)
                    new_tokens += len(sample[0])
                bar.update(len(done))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
                if stop["signal"] is not None:
                    writer.flush()
                    bar.close()
                    raise Stopped(f"stopped by {signal_name(stop['signal'])} after sample "
                                  f"{base + m['samples'] - 1}", signal_exit(stop["signal"]))
        except Stopped:
            raise
        except Exception:  # the engine failed: keep what it made before
            try:
                writer.flush()
            except Exception:
                log.warning("could not write the samples held before the failure",
                            exc_info=True, extra=console.LOG_ONLY)
            bar.close()
            raise
        writer.flush()
    bar.close()
    return new_tokens


# Data-parallel extraction. A round of `workers` workers extracts the samples
# [base, target) the folder lacks: ROUND (written once, by the first worker to start)
# fixes the ranges, worker i extracts range i into parts/<first>-<end>/ (a folder with its
# own manifest, resumable like the top one, under its own lock); whoever sees every part
# whole, under the folder's lock, appends the parts' shards to the top manifest in sample
# order and removes ROUND. Readers read only the top manifest, so they never see a part.
# A single process (extract.workers=1, e.g. stage=train) meeting a pending round finishes
# it first: it waits for each part a live worker holds and extracts any part nobody is
# running, so nothing is extracted twice and nothing partial is read.
PARTS = "parts"
ROUND = "round.json"


def part_ranges(base: int, target: int, workers: int) -> List[List[int]]:
    """`workers` contiguous ranges covering [base, target), sizes differing by at most one."""
    n = target - base
    return [[base + n * i // workers, base + n * (i + 1) // workers] for i in range(workers)]


def part_folder(out: Path, first: int, end: int) -> Path:
    return out / PARTS / f"{first:010d}-{end:010d}"


def pending_round(out: Path, m: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The round of workers still extracting into `out` (manifest `m`), if any."""
    path = out / ROUND
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    if m["samples"] >= r["target"] and m["samples"] != r["base"]:
        path.unlink(missing_ok=True)  # joined, then cut off before its removal
        return None
    if m["samples"] != r["base"]:
        raise artifacts.ArtifactError(
            f"{path}: a round of {r['workers']} workers extracting samples {r['base']}.."
            f"{r['target'] - 1}, but {out / artifacts.MANIFEST} holds {m['samples']} samples; "
            f"remove {path} and this round's part folders ("
            + ", ".join(part_folder(out, a, b).name for a, b in r["parts"]) +
            f" under {out / PARTS}) to start the round again")
    return r


def _open_part(plan: RunPlan, first: int, end: int) -> tuple:
    folder = part_folder(plan.hidden.folder, first, end)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / artifacts.MANIFEST).exists():
        m = artifacts.read_manifest(folder)
        if m.get("fingerprint") != plan.hidden.fingerprint:
            raise artifacts.ArtifactError(f"{folder / artifacts.MANIFEST}: a part of other "
                                          "hidden states; remove it")
    else:
        m = artifacts.new_manifest("hidden-part", plan.config, plan.hidden.fingerprint,
                                   shards=[], samples=0, first_sample=first, end=end)
        m["complete"] = True
        artifacts.write_json_atomic(folder / artifacts.MANIFEST, m)
    adopted = shards.adopt_orphans(folder, m)
    if adopted:
        log.info("adopting %d shard(s) of %s written before an interruption", len(adopted), folder)
        m["shards"] += adopted
        m["samples"] += sum(a["num_samples"] for a in adopted)
        artifacts.write_json_atomic(folder / artifacts.MANIFEST, m)
    return folder, m


def _join(out: Path, m: Dict[str, Any], r: Dict[str, Any]) -> bool:
    """Under the folder's lock: append every part of round `r` to the manifest `m` when
    all are whole; False while some part is missing samples or its worker still holds it
    (its last samples written, its run not yet recorded: that worker joins after it)."""
    entries, runs = [], []
    for first, end in r["parts"]:
        if end == first:
            continue
        folder = part_folder(out, first, end)
        pm = (artifacts.read_manifest(folder)
              if (folder / artifacts.MANIFEST).exists() else None)
        if pm is None or pm["samples"] < end - first or _held(folder):
            return False
        rel = folder.relative_to(out).as_posix()
        entries += [{**e, "name": f"{rel}/{e['name']}"} for e in pm["shards"]]
        runs += [{**run, "part": rel} for run in pm.get("runs", [])]
    m["shards"] += entries
    m["samples"] = r["target"]
    m.setdefault("runs", []).extend(runs)
    artifacts.write_json_atomic(out / artifacts.MANIFEST, m)
    (out / ROUND).unlink(missing_ok=True)
    log.info("joined %d parts of %d workers: %s holds %d samples in %d shards",
             len([p for p in r["parts"] if p[1] > p[0]]), r["workers"], out, m["samples"],
             len(m["shards"]))
    return True


def _extract_part(plan: RunPlan, settings: ExtractConfig, first: int, end: int,
                  data: Dict[str, Any], engine: _Engine, head: Any, owner: str,
                  label: str) -> int:
    """Extract samples [first, end), `owner`'s part ("worker i of n"), into their part
    folder under the part's lock; return the new tokens (0: it was whole already)."""
    from eagle3x.weights import torch_dtype

    folder = part_folder(plan.hidden.folder, first, end)
    with _exclusive(folder, f"another process ({owner}) is extracting samples "
                            f"{first}..{end - 1}"):
        folder, pm = _open_part(plan, first, end)
        bad = _bad_shards(folder, pm, settings.verify)
        if pm["samples"] >= end - first and not bad:
            return 0
        if pm["samples"] < end - first:
            log.info("%s: extracting samples %d..%d with engine=%s into %s", label,
                     first + pm["samples"], end - 1, engine.name, folder)
        writer = _Writer(folder, plan.hidden.fingerprint, pm, torch_dtype(settings.dtype.value),
                         settings.shard_tokens, plan.hidden_format, head)
        t0, before, load0 = time.perf_counter(), pm["samples"], engine.load_s
        tokens = _fill(folder, pm, end, bad, data, engine, writer, settings, label)
        _record_run(folder, pm, engine, pm["samples"] - before, tokens,
                    time.perf_counter() - t0 - (engine.load_s - load0))
        return tokens


def _record_run(folder: Path, m: Dict[str, Any], engine: _Engine, samples: int, tokens: int,
                wall: float) -> None:
    m.setdefault("runs", []).append({
        "engine": engine.name, "samples": samples, "tokens": tokens, "seconds": round(wall, 3),
        "engine_start_seconds": round(engine.load_s, 3),
        "tokens_per_second": round(tokens / max(wall, 1e-9), 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    artifacts.write_json_atomic(folder / artifacts.MANIFEST, m)


class _TeacherHead:
    """(the verifier's lm_head, on the GPU when there is one; its soft-cap; its logit
    scale) for a top-k teacher, loaded at the first sample written: after the engine has
    started and taken its memory, and never when nothing is extracted."""

    def __init__(self, plan: RunPlan):
        self.plan, self.loaded = plan, None

    def get(self) -> tuple:
        if self.loaded is None:
            import torch

            from eagle3x.weights import verifier_head

            head = verifier_head(self.plan.verifier.path, self.plan.verifier.tied_head)
            head = head.to("cuda") if torch.cuda.is_available() else head.float()
            info = self.plan.verifier.info
            self.loaded = (head, info.logit_softcap, info.logit_scale)
        return self.loaded


def _teacher_head(plan: RunPlan) -> Any:
    return _TeacherHead(plan) if plan.hidden_format["teacher"] == "topk" else None


def extract(plan: RunPlan, settings: ExtractConfig, engine_name: str,
            open_engine: Callable[[], Any], worker: int = 0) -> Outcome:
    """Make sure ``plan.hidden.folder`` holds the hidden states of every sample the plan
    needs, extracting the missing ones with the engine `open_engine()` returns (opened only
    when there is work; `engine_name` is what the log and the manifest call it).

    With ``settings.workers`` > 1 this process is worker `worker` of a data-parallel round
    and extracts only its range; the artifact is whole once the last worker joins the parts.
    """
    out = plan.hidden.folder
    data = prepared.load(plan.prepared.folder)
    target = plan.split.extract_until(data["n"])
    if settings.workers > 1:
        return _extract_as_worker(plan, settings, engine_name, open_engine, worker, data, target)
    from eagle3x.weights import torch_dtype

    engine = _Engine(open_engine, engine_name)
    t_start = time.perf_counter()
    t_end = None  # before the engine shuts down (vLLM takes seconds), which is not extraction
    new_tokens = 0
    try:
        with _exclusive(out, "another eagle3x process is extracting into this folder"):
            m = open_manifest(plan)
            r = pending_round(out, m)
            bad = _bad_shards(out, m, settings.verify)
            if m["samples"] >= target and not bad:
                log.info("reusing hidden states at %s: %d samples in %d shards (%d asked for)%s",
                         out, m["samples"], len(m["shards"]), target,
                         "" if r is None else f"; {r['workers']} workers are extracting "
                         f"samples {r['base']}..{r['target'] - 1}, which this run does not read")
                return Outcome("hidden", "reused", out)
            done_before, shards_before = m["samples"], len(m["shards"])
            head = _teacher_head(plan)
            if r is not None:
                log.info("%s: %d workers are extracting samples %d..%d; finishing their round "
                         "(waiting for the parts a worker holds)", out, r["workers"],
                         r["base"], r["target"] - 1)
                for i, (first, end) in enumerate(r["parts"]):
                    if end > first:
                        new_tokens += _extract_part(
                            plan, settings, first, end, data, engine, head,
                            f"worker {i} of {r['workers']}", f"worker {i} (taken over)")
                _join(out, m, r)
                bad = _bad_shards(out, m, settings.verify)
            if m["samples"] < target or bad:
                if m["samples"] < target:
                    log.info("extracting samples %d..%d with engine=%s into %s", m["samples"],
                             target - 1, engine_name, out)
                writer = _Writer(out, plan.hidden.fingerprint, m,
                                 torch_dtype(settings.dtype.value), settings.shard_tokens,
                                 plan.hidden_format, head)
                t0, before, load0 = time.perf_counter(), m["samples"], engine.load_s
                tokens = _fill(out, m, target, bad, data, engine, writer, settings, "extract")
                new_tokens += tokens
                _record_run(out, m, engine, m["samples"] - before, tokens,
                            time.perf_counter() - t0 - (engine.load_s - load0))
            t_end = time.perf_counter()
    finally:
        engine.close()
    wall = (t_end or time.perf_counter()) - t_start - engine.load_s
    total_tokens = sum(s["tokens"] for s in m["shards"])
    total_bytes = sum(s["bytes"] for s in m["shards"])
    log.info("extracted %d new samples (%d tokens, %.0f tok/s) in %.1fs (+%.1fs engine start); folder holds %d samples, "
             "%d tokens, %d shards (+%d), %.0f bytes/token -> %s", m["samples"] - done_before,
             new_tokens, new_tokens / max(wall, 1e-9), wall, engine.load_s, m["samples"],
             total_tokens, len(m["shards"]), len(m["shards"]) - shards_before,
             total_bytes / max(total_tokens, 1), out)
    return Outcome("hidden", "built", out)


def _extract_as_worker(plan: RunPlan, settings: ExtractConfig, engine_name: str,
                       open_engine: Callable[[], Any], worker: int, data: Dict[str, Any],
                       target: int) -> Outcome:
    out, n = plan.hidden.folder, settings.workers
    with _exclusive(out, "another eagle3x process holds this folder"):
        m = open_manifest(plan)
        r = pending_round(out, m)
        if r is None:
            if m["samples"] >= target:
                log.info("worker %d of %d: %s already holds %d samples (%d asked for)",
                         worker, n, out, m["samples"], target)
                return Outcome("hidden", "reused", out)
            r = {"base": m["samples"], "target": target, "workers": n,
                 "parts": part_ranges(m["samples"], target, n)}
            artifacts.write_json_atomic(out / ROUND, r)
        elif r["workers"] != n or r["target"] != target:
            raise artifacts.ArtifactError(
                f"{out / ROUND}: a round of {r['workers']} workers extracting samples "
                f"{r['base']}..{r['target'] - 1} is under way; this worker has "
                f"extract.workers={n} and wants samples up to {target - 1}. Run the round's "
                f"missing workers with extract.workers={r['workers']} (and the same "
                "data.num_samples), or let extract.workers=1 finish it.")
    first, end = r["parts"][worker]
    engine = _Engine(open_engine, engine_name)
    try:
        tokens = (_extract_part(plan, settings, first, end, data, engine, _teacher_head(plan),
                                f"worker {worker} of {n}", f"worker {worker} of {n}")
                  if end > first else 0)
    finally:
        engine.close()
    with _exclusive(out, "another eagle3x process holds this folder"):
        m = open_manifest(plan)
        r2 = pending_round(out, m)
        joined = r2 is None or _join(out, m, r2)
    log.info("worker %d of %d: samples %d..%d %s (%d new tokens); %s", worker, n, first,
             end - 1, "extracted" if tokens else "were whole", tokens,
             f"all parts joined: {out} holds {m['samples']} samples" if joined
             else "waiting for the other workers' parts before the folder is whole")
    return Outcome("hidden", "built" if tokens else "reused", out)


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
        from eagle3x.distributed import extract_worker

        worker, _ = extract_worker(self.extract.workers, self.extract.worker)
        done.append(extract(self.plan, self.extract, self.engine.name.value, self.open_engine,
                            worker))
        return done
