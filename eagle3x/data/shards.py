"""Hidden-state shards: the storage contract of `extract` and what training reads.

A folder holds ``manifest.json`` and ``shard-00000.safetensors``, ... Each shard holds
whole samples:

    input_ids   int32 [T]        loss_mask  uint8 [T]
    aux_hidden  [T, 3H]          last_hidden [T, H]       (bf16 by default)
    offsets     int64 [n+1]      sample k is rows offsets[k]:offsets[k+1]

(the default format; the manifest's "format" names others, whose per-token tensors
``data/compact.py`` lists: fp8 / int8 aux with scales, a top-k teacher). A manifest entry's
name may be a path inside the folder (``parts/...``: shards a worker of a data-parallel
extraction wrote, ``data/extraction.py``).

and its header metadata names its first sample, sample count and the folder's
fingerprint. A shard is written to a temp name, fsynced and renamed; then the manifest
is replaced atomically. A crash at any moment leaves only whole shards; a shard renamed
just before a crash, but not yet in the manifest, is adopted on the next run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from eagle3x import artifacts

#: The tensors every shard holds, whatever its format.
COMMON = ("input_ids", "loss_mask", "offsets")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(folder: Path, index: int, tensors: Dict[str, Any], first_sample: int,
                fingerprint: str) -> Dict[str, Any]:
    """Write one shard atomically; return its manifest entry."""
    from safetensors.torch import save_file

    final = folder / shard_name(index)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    n = int(tensors["offsets"].numel() - 1)
    meta = {"first_sample": str(first_sample), "num_samples": str(n), "fingerprint": fingerprint}
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(folder)
    return {"name": final.name, "first_sample": first_sample, "num_samples": n,
            "tokens": int(tensors["offsets"][-1]), "bytes": final.stat().st_size,
            "sha256": artifacts.sha256_file(final)}


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_header(path: Path) -> Dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def adopt_orphans(folder: Path, manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Shards renamed into place whose manifest update a crash cut off; temp files removed.

    A file is adopted only when it is the next shard in order, its header matches this
    folder's fingerprint and continues the sample sequence; anything else is deleted.
    """
    for p in folder.glob(".shard-*.tmp-*"):
        p.unlink(missing_ok=True)
    known = {s["name"] for s in manifest["shards"]}
    adopted = []
    nxt = len(manifest["shards"])
    first = manifest.get("first_sample", 0) + manifest["samples"]  # a part starts later
    for p in sorted(folder.glob("shard-*.safetensors")):
        if p.name in known:
            continue
        try:
            meta = shard_header(p)
            ok = (p.name == shard_name(nxt) and meta.get("fingerprint") == manifest["fingerprint"]
                  and int(meta.get("first_sample", -1)) == first)
        except Exception:
            ok = False
        if not ok:
            p.unlink()
            continue
        entry = {"name": p.name, "first_sample": first, "num_samples": int(meta["num_samples"]),
                 "bytes": p.stat().st_size, "sha256": artifacts.sha256_file(p)}
        entry["tokens"] = _tokens_in(p)
        adopted.append(entry)
        nxt += 1
        first += entry["num_samples"]
    return adopted


def _tokens_in(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return int(f.get_slice("input_ids").get_shape()[0])


class ShardReader:
    """Random access to the samples of a hidden-state folder, shards memory-mapped.

    ``reader[i]`` is sample i as training reads it: input_ids, loss_mask, aux_hidden and
    the teacher (last_hidden, or topk_ids + topk_logp), decoded from the folder's format.
    """

    def __init__(self, folder: str | Path, num_samples: Optional[int] = None,
                 verify: str = "size", repair_hint: str = ""):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.manifest = artifacts.read_manifest(self.folder)
        from eagle3x.data import compact

        self.format = self.manifest.get("format") or {"aux": "native", "teacher": "hidden"}
        self.keys = ("input_ids", "loss_mask") + compact.keys(self.format)
        self.index: List[tuple] = []
        self._files = []
        for entry in self.manifest["shards"]:
            why = artifacts.check_entry(self.folder, entry, full=(verify == "sha256"))
            if why:
                raise artifacts.ArtifactError(why + (f"\n  re-extract it: {repair_hint}" if repair_hint else ""))
            try:
                f = safe_open(str(self.folder / entry["name"]), framework="pt")
                offsets = f.get_tensor("offsets")
            except Exception as exc:
                raise artifacts.ArtifactError(f"{self.folder / entry['name']}: unreadable ({exc})")
            self._files.append(f)
            for k in range(entry["num_samples"]):
                self.index.append((len(self._files) - 1, int(offsets[k]), int(offsets[k + 1])))
        if num_samples is not None:
            if num_samples > len(self.index):
                raise artifacts.ArtifactError(f"{self.folder}: holds {len(self.index)} samples, "
                                              f"{num_samples} asked for")
            self.index = self.index[:num_samples]

    def __len__(self) -> int:
        return len(self.index)

    def length(self, i: int) -> int:
        """Tokens in sample i."""
        _, a, b = self.index[i]
        return b - a

    def __getitem__(self, i: int) -> Dict[str, Any]:
        from eagle3x.data.compact import decode

        fi, a, b = self.index[i]
        f = self._files[fi]
        return decode({k: f.get_slice(k)[a:b] for k in self.keys})
