"""Read a W&B offline run folder (``wandb/offline-run-*``) without network or the W&B API.

The run's ``run-<id>.wandb`` file is a LevelDB-style log of protobuf records (the format
`wandb sync` uploads): a 7-byte header, then 32 KiB blocks of chunks
``crc32c(4) length(2) type(1) payload``; types 1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST.
This reader returns the run's config, history rows and summary.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run log (bad magic)")
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:  # zero padding at the end of a file being written
            break


def _value(item: Any) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    fields = item.DESCRIPTOR.fields_by_name
    for name in ("number", "integer", "boolean", "text"):
        if name in fields and item.HasField(name):
            return getattr(item, name)
    return None


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_run(folder: str | Path) -> Dict[str, Any]:
    """{"id", "config", "history": [row, ...], "summary"} of an offline run folder."""
    from wandb.proto import wandb_internal_pb2 as pb

    folder = Path(folder)
    logs = sorted(folder.glob("run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"{folder}: no run-*.wandb log")
    config: Dict[str, Any] = {}
    history: List[Dict[str, Any]] = []
    summary: Dict[str, Any] = {}
    run: Dict[str, Any] = {}
    for payload in _payloads(logs[0].read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "config":
            for item in rec.config.update:
                config[_key(item)] = _value(item)
        elif kind == "history":
            history.append({_key(i): _value(i) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                summary[_key(item)] = _value(item)
        elif kind == "run":
            for item in rec.run.config.update:
                config[_key(item)] = _value(item)
            run = {"id": rec.run.run_id, "name": rec.run.display_name, "group": rec.run.run_group,
                   "job_type": rec.run.job_type, "tags": list(rec.run.tags)}
    return {**run, "config": config, "history": history, "summary": summary}
