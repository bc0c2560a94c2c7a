"""Prepared data: conversations -> chat template -> token ids + assistant loss mask.

A folder holds ``prepared.safetensors`` (``input_ids`` int32 [T], ``loss_mask`` uint8 [T],
``offsets`` int64 [n+1], ``source_line`` int64 [n]) and ``manifest.json``. Samples are
stored in one seeded order (conversations shuffled with ``data.seed``; the samples of a
conversation cut by ``data.split_turns`` stay together, in turn order), so
``data.num_samples=N`` always means the same first N. ``build`` makes it (or reuses a
finished folder with the same fingerprint); ``load`` opens it memory-mapped.

Bounded memory, resumable. The input is read once, as a stream, in chunks of
``data.chunk_size`` conversations; ``data.num_proc`` tokenizer processes (spawned, each
loading the tokenizer once) encode chunks while the reader goes on, and each finished
chunk is written (ids, mask, then its small json record last) into a scratch folder
``.<name>.chunks`` beside the output. Then the samples are written in the seeded order
straight into the safetensors file (header first, then each tensor streamed, hashed as
it is written), and the folder is published in one rename. Memory holds a few chunks and
~40 bytes per sample, whatever the file size. A killed run resumes after the last whole
chunk (the reader seeks to where it ended); bad input removes the scratch folder, so
nothing half-written stays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import deque
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from eagle3x import artifacts, console
from eagle3x.artifacts import Outcome
from eagle3x.plan import RunPlan

log = logging.getLogger("eagle3x")
FILE = "prepared.safetensors"
#: Input records per chunk below which one process does everything (no worker start).
_INLINE_CHUNKS = 1


def build(plan: RunPlan) -> Outcome:
    """The prepared data of `plan` at ``plan.prepared.folder``, built unless already there."""
    out = plan.prepared.folder
    if artifacts.reuse(out, plan.prepared.fingerprint, "prepared data"):
        log.info("reusing prepared data at %s (same inputs and settings)", out)
        return Outcome("prepared", "reused", out)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    # Several workers of a data-parallel extraction start together: one builds, the
    # others wait here and reuse it (never replacing a folder another one is reading).
    with FileLock(str(out.parent / f".{out.name}.prepare.lock")):
        if artifacts.reuse(out, plan.prepared.fingerprint, "prepared data"):
            log.info("reusing prepared data at %s (built meanwhile by another process)", out)
            return Outcome("prepared", "reused", out)
        return _build(plan)


# -- encoding a chunk (in a worker process, or inline) -------------------------------------

_WORKER: Dict[str, Any] = {}


def _init_worker(verifier: str, trust_remote_code: bool) -> None:
    from eagle3x.verifier import load_tokenizer

    _WORKER["tok"] = load_tokenizer(verifier, trust_remote_code)


def encode_chunk(items: List[Tuple[int, Any]], label: str, fmt: str, fields: Any,
                 settings: Any) -> Dict[str, Any]:
    """Encode conversations `items` ((line or row, raw bytes or record) each) with the
    worker's tokenizer: token ids, masks and per-sample lengths, lines and conversation
    indices (within the chunk), counts."""
    import numpy as np

    from eagle3x.data.chat import encode_conversation
    from eagle3x.data.conversations import normalize, parse_line

    tok = _WORKER["tok"]
    ids, masks, lengths, lines, convs = [], [], [], [], []
    stats: Dict[str, int] = {"truncated": 0, "dropped_no_assistant_token": 0}
    for k, (line, payload) in enumerate(items):
        if isinstance(payload, (bytes, bytearray)):
            where = f"{label}:{line}"
            conv = parse_line(payload, where, fmt, fields)
        else:
            where = f"{label}: row {line}"
            conv = normalize(payload, where, fmt, fields)
        for t_ids, t_mask, cut in encode_conversation(tok, conv.messages, conv.tools, where,
                                                      settings, stats):
            if not any(t_mask):
                stats["dropped_no_assistant_token"] += 1  # truncation removed every one
                continue
            stats["truncated"] += cut
            ids.append(np.asarray(t_ids, dtype=np.int32))
            masks.append(np.asarray(t_mask, dtype=np.uint8))
            lengths.append(len(t_ids))
            lines.append(line)
            convs.append(k)
    return {"ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
            "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            "lengths": lengths, "lines": lines, "convs": convs, "stats": stats,
            "conversations": len(items)}


# -- reading the source in chunks ----------------------------------------------------------


def _chunks(src: Any, size: int, start: Dict[str, int]) -> Iterator[Tuple[List[Tuple[int, Any]], Dict[str, int]]]:
    """(items, where the next chunk starts) for consecutive chunks of `size` conversations,
    from position `start` ({"offset", "line"} in a jsonl file, {"row"} in a dataset)."""
    from eagle3x.data.conversations import dataset_rows, jsonl_lines

    items: List[Tuple[int, Any]] = []
    if src.is_jsonl:
        pos = {"offset": start.get("offset", 0), "line": start.get("line", 1)}
        for lineno, end, raw in jsonl_lines(src.path, pos["offset"], pos["line"]):
            items.append((lineno, raw))
            if len(items) == size:
                yield items, {"offset": end, "line": lineno + 1}
                items = []
            pos = {"offset": end, "line": lineno + 1}
        if items:
            yield items, pos
        return
    row = start.get("row", 0)
    for r, record in dataset_rows(src, row):
        items.append((r, record))
        if len(items) == size:
            yield items, {"row": r}
            items = []
    if items:
        yield items, {"row": items[-1][0]}


# -- the scratch folder of chunks ----------------------------------------------------------


class _Scratch:
    """`.<name>.chunks` beside the output: chunk k's ids, mask (raw) and record (json,
    written last: a chunk is whole when its record is there and the sizes agree)."""

    def __init__(self, out: Path, state: Dict[str, Any]):
        self.dir = out.parent / f".{out.name}.chunks"
        self.state = state

    def open(self) -> List[Dict[str, Any]]:
        """The whole chunks already there for this state (0..m-1), clearing the rest."""
        try:
            same = json.loads((self.dir / "state.json").read_text()) == self.state
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            artifacts.write_json_atomic(self.dir / "state.json", self.state)
            return []
        done = []
        while True:
            rec = self._record(len(done))
            if rec is None:
                break
            done.append(_compact(rec))
        for p in self.dir.glob("chunk-*"):  # anything after the last whole chunk
            if int(p.name.split("-")[1].split(".")[0]) >= len(done):
                p.unlink()
        return done

    def _record(self, k: int) -> Optional[Dict[str, Any]]:
        try:
            rec = json.loads((self.dir / f"chunk-{k:06d}.json").read_text())
            if ((self.dir / f"chunk-{k:06d}.ids").stat().st_size != 4 * rec["tokens"] or
                    (self.dir / f"chunk-{k:06d}.mask").stat().st_size != rec["tokens"]):
                return None
            return rec
        except (OSError, ValueError, KeyError):
            return None

    def write(self, k: int, result: Dict[str, Any], first_conv: int, nxt: Dict[str, int]
              ) -> Dict[str, Any]:
        for ext, arr in (("ids", result["ids"]), ("mask", result["mask"])):
            with open(self.dir / f"chunk-{k:06d}.{ext}", "wb") as f:
                f.write(arr.tobytes())
                f.flush()
                os.fsync(f.fileno())
        rec = {"index": k, "first_conv": first_conv, "conversations": result["conversations"],
               "tokens": int(len(result["ids"])), "loss_tokens": int(result["mask"].sum()),
               "lengths": result["lengths"], "lines": result["lines"],
               "convs": [first_conv + c for c in result["convs"]],
               "stats": result["stats"], "next": nxt}
        artifacts.write_json_atomic(self.dir / f"chunk-{k:06d}.json", rec)
        return _compact(rec)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _compact(rec: Dict[str, Any]) -> Dict[str, Any]:
    """A chunk record with its per-sample lists as int64 arrays (8 bytes a value)."""
    import numpy as np

    for key in ("lengths", "lines", "convs"):
        rec[key] = np.asarray(rec[key], dtype=np.int64)
    return rec


def _pool(workers: int, plan: RunPlan) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                               initializer=_init_worker,
                               initargs=(str(plan.verifier.path), plan.verifier.trust_remote_code))


def _build(plan: RunPlan) -> Outcome:
    from tqdm import tqdm

    from eagle3x.data.chat import settings_of
    from eagle3x.data.conversations import DataError, reader as reader_of

    out, src = plan.prepared.folder, plan.source
    reader = reader_of(src)
    settings = settings_of(src)
    size = src.chunk_size
    scratch = _Scratch(out, {"fingerprint": plan.prepared.fingerprint, "chunk_size": size})
    done = scratch.open()
    total = src.records  # None for datasets folders and regenerated replies (made since)
    if total is None and reader.is_jsonl:
        total = artifacts.input_facts(reader.path).records
    workers = src.num_proc if total is None or total > size * _INLINE_CHUNKS else 1
    start = done[-1]["next"] if done else {}
    first_conv = sum(r["conversations"] for r in done)
    if done:
        log.info("resuming prepare after %d whole chunks (%d conversations) in %s",
                 len(done), first_conv, scratch.dir)
    bar = tqdm(total=total, initial=first_conv, desc="prepare", unit="conv",
               disable=(total or 0) < 2000, file=console.stream(),
               mininterval=0.5 if console.is_terminal() else 10)
    pool = None
    try:
        args = (reader.label, reader.format, reader.fields, settings)
        if workers > 1:
            pool = _pool(workers, plan)
            inflight: deque = deque()
            chunks = _chunks(reader, size, start)
            for items, nxt in chunks:
                inflight.append((pool.submit(encode_chunk, items, *args), nxt))
                if len(inflight) >= 2 * workers:
                    first_conv = _finish_chunk(scratch, done, inflight.popleft(), first_conv, bar)
            while inflight:
                first_conv = _finish_chunk(scratch, done, inflight.popleft(), first_conv, bar)
        else:
            _init_worker(str(plan.verifier.path), plan.verifier.trust_remote_code)
            for items, nxt in _chunks(reader, size, start):
                result = encode_chunk(items, *args)
                done.append(scratch.write(len(done), result, first_conv, nxt))
                first_conv += result["conversations"]
                bar.update(result["conversations"])
    except DataError:
        scratch.remove()  # bad input: nothing half-written stays
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    outcome = _assemble(plan, scratch, done)
    scratch.remove()
    return outcome


def _finish_chunk(scratch: _Scratch, done: List[Dict[str, Any]], job: Tuple[Any, Dict[str, int]],
                  first_conv: int, bar: Any) -> int:
    future, nxt = job
    result = future.result()
    done.append(scratch.write(len(done), result, first_conv, nxt))
    bar.update(result["conversations"])
    return first_conv + result["conversations"]


# -- the seeded order, written straight into the safetensors file --------------------------

_DTYPES = {"int64": ("I64", 8), "int32": ("I32", 4), "uint8": ("U8", 1)}


def _header(tensors: List[Tuple[str, str, int]]) -> Tuple[bytes, Dict[str, Tuple[int, int]]]:
    """safetensors header for (name, numpy dtype, length) tensors laid out in order."""
    meta, spans, pos = {}, {}, 0
    for name, dtype, n in tensors:
        code, width = _DTYPES[dtype]
        meta[name] = {"dtype": code, "shape": [n], "data_offsets": [pos, pos + n * width]}
        spans[name] = (pos, pos + n * width)
        pos += n * width
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, spans


def _assemble(plan: RunPlan, scratch: _Scratch, done: List[Dict[str, Any]]) -> Outcome:
    import numpy as np

    out, src = plan.prepared.folder, plan.source
    n_conv = sum(r["conversations"] for r in done)
    lengths = np.concatenate([r["lengths"] for r in done])
    if not len(lengths):
        raise artifacts.ArtifactError(f"{src.label}: no sample keeps an assistant token within "
                                      f"extract.max_seq_len={src.max_seq_len}")
    lines = np.concatenate([r["lines"] for r in done])
    conv = np.concatenate([r["convs"] for r in done])
    chunk = np.repeat(np.arange(len(done)), [len(r["lengths"]) for r in done])
    start = np.concatenate([np.cumsum(r["lengths"]) - r["lengths"] for r in done])
    rank = np.empty(n_conv, dtype=np.int64)
    rank[np.random.default_rng(src.seed).permutation(n_conv)] = np.arange(n_conv)
    order = np.lexsort((np.arange(len(conv)), rank[conv]))
    offsets = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)
    total = int(offsets[-1])
    header, spans = _header([("offsets", "int64", len(order) + 1),
                             ("source_line", "int64", len(order)),
                             ("input_ids", "int32", total), ("loss_mask", "uint8", total)])
    stats = _stats(done, lengths, n_conv)
    manifest = artifacts.new_manifest("prepared", plan.config, plan.prepared.fingerprint,
                                      stats=stats, settings=src.settings())
    fds = {}
    try:
        for k in range(len(done)):
            fds[("ids", k)] = os.open(scratch.dir / f"chunk-{k:06d}.ids", os.O_RDONLY)
            fds[("mask", k)] = os.open(scratch.dir / f"chunk-{k:06d}.mask", os.O_RDONLY)
        with artifacts.building(out) as tmp:
            h = hashlib.sha256()
            path = Path(tmp) / FILE
            with open(path, "wb") as f:
                def put(data: bytes) -> None:
                    h.update(data)
                    f.write(data)

                put(header)
                put(offsets.tobytes())
                put(lines[order].tobytes())
                for ext, width in (("ids", 4), ("mask", 1)):
                    buf, held = [], 0
                    for s in order:
                        n = int(lengths[s])
                        buf.append(os.pread(fds[(ext, int(chunk[s]))], n * width,
                                            int(start[s]) * width))
                        held += n * width
                        if held >= 1 << 24:
                            put(b"".join(buf))
                            buf, held = [], 0
                    put(b"".join(buf))
                f.flush()
                os.fsync(f.fileno())
            manifest["tokenizer_vocab_size"] = _vocab_size(plan)
            manifest["files"] = [{"name": FILE, "bytes": path.stat().st_size,
                                  "sha256": h.hexdigest()}]
            manifest["complete"] = True
            artifacts.write_json_atomic(Path(tmp) / artifacts.MANIFEST, manifest)
    finally:
        for fd in fds.values():
            os.close(fd)
    _report(stats, plan, out)
    return Outcome("prepared", "built", out)


def _vocab_size(plan: RunPlan) -> int:
    tok = _WORKER.get("tok")
    if tok is None:
        from eagle3x.verifier import load_tokenizer

        tok = load_tokenizer(plan.verifier.path, plan.verifier.trust_remote_code)
    return len(tok)


def _stats(done: List[Dict[str, Any]], lengths: Any, n_conv: int) -> Dict[str, Any]:
    import numpy as np

    from eagle3x.data.chat import STAT_KEYS

    summed: Dict[str, int] = {}
    for r in done:
        for k, v in r["stats"].items():
            summed[k] = summed.get(k, 0) + v
    stats: Dict[str, Any] = {
        "samples": int(len(lengths)), "tokens": int(lengths.sum()),
        "loss_tokens": sum(r["loss_tokens"] for r in done),
        "truncated": summed.get("truncated", 0),
        "dropped_no_assistant_token": summed.get("dropped_no_assistant_token", 0),
        "mean_tokens": float(np.mean(lengths)), "max_tokens": int(lengths.max()),
        "input_conversations": n_conv,
    }
    stats["turns"] = {k: summed.get(k, 0) for k in STAT_KEYS}
    return stats


def _report(stats: Dict[str, Any], plan: RunPlan, out: Path) -> None:
    log.info("prepared %d samples, %d tokens (%d trained), %d truncated, %d dropped -> %s",
             stats["samples"], stats["tokens"], stats["loss_tokens"], stats["truncated"],
             stats["dropped_no_assistant_token"], out)
    t = stats["turns"]
    if t["reasoning_turns"] or t["tool_call_turns"] or t["tool_results"] or t["split_conversations"]:
        log.info("%d assistant turns in %d conversations: %d with reasoning, %d with tool calls; "
                 "%d tool results (not trained)%s", t["assistant_turns"],
                 stats["input_conversations"], t["reasoning_turns"], t["tool_call_turns"],
                 t["tool_results"],
                 f"; {t['split_conversations']} conversations cut into one sample per turn "
                 "group (data.split_turns)" if t["split_conversations"] else "")
    for key, what in (("reasoning_not_rendered", "reasoning"),
                      ("tool_calls_not_rendered", "tool calls")):
        if t[key]:
            log.warning("the chat template of %s does not render the %s of %d assistant turns: "
                        "the draft never sees those tokens (serving with this template would "
                        "not show them either)", plan.verifier.path, what, t[key])


# -- reading -------------------------------------------------------------------------------


def load(folder: str | Path, num_samples: Optional[int] = None, verify: bool = False) -> Dict[str, Any]:
    """Open prepared data (numpy arrays, memory-mapped copy-on-write: nothing is read until
    used), optionally only its first `num_samples`."""
    folder = Path(folder)
    m = artifacts.read_manifest(folder)
    if not m.get("complete"):
        raise artifacts.ArtifactError(f"{folder / artifacts.MANIFEST}: unfinished prepared data")
    artifacts.verify_files(folder, m, full=verify)
    try:
        t = _open_arrays(artifacts.safe_member(folder, FILE))
    except (OSError, ValueError, KeyError) as exc:
        raise artifacts.ArtifactError(f"{folder / FILE}: cannot be read as safetensors ({exc})")
    n = len(t["offsets"]) - 1
    if num_samples is not None and num_samples > n:
        raise artifacts.ArtifactError(f"{folder}: data.num_samples={num_samples} but the prepared "
                                      f"data holds {n} samples")
    return {"manifest": m, "n": n if num_samples is None else num_samples, **t}


def _open_arrays(path: Path) -> Dict[str, Any]:
    """The 1-d tensors of a safetensors file as copy-on-write memory maps."""
    import numpy as np

    codes = {"I64": np.int64, "I32": np.int32, "U8": np.uint8}
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    base = 8 + size
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = np.dtype(codes[spec["dtype"]])
        a, b = spec["data_offsets"]
        count = (b - a) // dtype.itemsize
        out[name] = (np.memmap(path, dtype=dtype, mode="c", offset=base + a, shape=(count,))
                     if count else np.zeros(0, dtype))
    return out
