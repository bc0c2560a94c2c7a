"""Artifact folders: where each stage writes, fingerprints of inputs, manifests, atomic writes.

Every artifact folder holds a ``manifest.json`` (schema version, the config that made
it, a fingerprint of its inputs, its files with sizes and sha256). Folders are built
under a temporary name and renamed into place, so a folder with a complete manifest
is always whole. Only json is read here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_EDGE = 1 << 20


class ArtifactError(Exception):
    """A stored artifact is missing, corrupt or from other inputs; the message names the file."""


def digest(obj: Any, n: int = 16) -> str:
    """A short stable hash of a json-able object."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: file_fingerprint's memo: (path, inode, size, mtime_ns) -> fingerprint. A file is read
#: once per process however many stages, sweep jobs or checks ask; an edit changes the key.
_FINGERPRINTS: Dict[tuple, str] = {}


def file_fingerprint(path: str | Path) -> str:
    """Content fingerprint of an input file or folder, cheap on large files.

    Files up to 64 MiB are hashed whole (the sha256 hex digest); larger ones by size plus
    their first and last MiB (a changed length or edited ends changes the fingerprint).
    """
    p = Path(path)
    if p.is_dir():
        return digest({f.relative_to(p).as_posix(): file_fingerprint(f)
                       for f in sorted(p.rglob("*")) if f.is_file()}, 64)
    st = p.stat()
    key = (str(p.absolute()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = _hash_input(p, st.st_size)
    return _FINGERPRINTS[key]


def _hash_input(p: Path, size: int) -> str:
    if size <= 64 * _EDGE:
        return sha256_file(p)
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write json to a temp file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_manifest(folder: str | Path) -> Dict[str, Any]:
    """The manifest of an artifact folder; ArtifactError naming the file if absent or bad."""
    path = Path(folder) / MANIFEST
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        raise ArtifactError(f"{path}: no manifest; this folder is not a finished eagle3x artifact")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid json ({exc})")
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot be read ({exc.strerror or exc})")
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: unknown manifest schema (expected version {SCHEMA_VERSION})")
    return data


def complete_manifest(folder: str | Path) -> Optional[Dict[str, Any]]:
    """The manifest if `folder` is a finished artifact, else None."""
    try:
        m = read_manifest(folder)
    except ArtifactError:
        return None
    return m if m.get("complete") else None


def file_entry(path: Path) -> Dict[str, Any]:
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def safe_member(folder: Path, name: str) -> Path:
    """`folder/name`, refusing names that would leave the folder (a manifest's `../x`):
    '/'-separated parts, none empty, hidden, '.' or '..', no backslash."""
    parts = name.split("/") if name else [""]
    if "\\" in name or any(not p or p.startswith(".") for p in parts):
        raise ArtifactError(f"{folder / MANIFEST}: file name {name!r} is not allowed")
    return folder.joinpath(*parts)


def check_entry(folder: Path, entry: Dict[str, Any], full: bool = False) -> Optional[str]:
    """Why a file a manifest lists is unusable (size always, sha256 when `full`), or None."""
    p = safe_member(folder, entry["name"])
    if not p.is_file():
        return f"{p}: listed in the manifest but missing"
    if p.stat().st_size != entry["bytes"]:
        return f"{p}: {p.stat().st_size} bytes, manifest says {entry['bytes']} (truncated or replaced)"
    if full and sha256_file(p) != entry["sha256"]:
        return f"{p}: sha256 differs from the manifest (corrupt)"
    return None


def verify_files(folder: Path, manifest: Dict[str, Any], full: bool = False) -> None:
    """Check the files a manifest lists; ArtifactError naming the first bad one."""
    for entry in manifest.get("files", []):
        why = check_entry(folder, entry, full)
        if why:
            raise ArtifactError(why)


@contextlib.contextmanager
def building(final: str | Path) -> Iterator[Path]:
    """Yield a temp folder beside `final`; on success it replaces `final` in one rename.

    On any error the temp folder is removed and `final` is left as it was.
    """
    from filelock import FileLock

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.build.lock")):
        # Under the lock no other builder is alive: leftovers are from a killed run.
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        os.chmod(tmp, 0o755)
        try:
            yield tmp
            if final.exists():
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def reuse(folder: Path, fingerprint: str, what: str) -> Optional[Dict[str, Any]]:
    """The manifest of a finished artifact with this fingerprint, or None: build it.

    A finished artifact made from other inputs is never overwritten: ArtifactError.
    """
    m = complete_manifest(folder)
    if m is None:
        return None
    if m.get("fingerprint") != fingerprint:
        raise ArtifactError(
            f"{folder / MANIFEST}: holds {what} made from other inputs or settings "
            f"(fingerprint {m.get('fingerprint')}, this run needs {fingerprint}); "
            "choose another output folder or remove it")
    return m


@dataclass(frozen=True)
class Outcome:
    """What a stage did: built or reused (or wrote) which artifact, where."""

    kind: str
    status: str  # "built" | "reused" | "wrote" | "rank" (a training rank other than 0)
    path: Path


def new_manifest(kind: str, config: Dict[str, Any], fingerprint: str, **extra: Any) -> Dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "fingerprint": fingerprint,
            "config": config, "complete": False, **extra}
