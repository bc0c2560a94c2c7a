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
_EDGE = 1 << 20  # the longest first record remembered


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


#: Input facts in this process: (path, inode, size, mtime_ns, ctime_ns) -> InputFacts. A
#: file is read once per process however many stages, sweep jobs or checks ask; an edit
#: changes the key. `memo` folders keep them across processes (input_facts).
_FINGERPRINTS: Dict[tuple, "InputFacts"] = {}
#: Records parsed for the sample facts (first record, characters per record).
SAMPLE_RECORDS = 200
_BLOCK = 1 << 22


@dataclass(frozen=True)
class InputFacts:
    """What one read of an input file tells: its sha256 and, for a jsonl file, how many
    records (non-blank lines) it holds, its first record and the text characters of its
    first records (for size estimates). Read once and remembered by (path, inode, size,
    mtime, ctime)."""

    sha256: str
    size: int
    #: non-blank lines
    records: int
    #: the first non-blank line (None when the file has none or it is over 1 MiB)
    first_record: Optional[bytes]
    #: parsed records among the first SAMPLE_RECORDS and the characters of their strings
    sampled: int = 0
    sample_chars: int = 0
    #: the first non-blank line is not UTF-8 / not json (the reason), so it was not sampled
    first_problem: Optional[str] = None
    #: the line number of the first non-blank line
    first_line: int = 1


def _stat_key(p: Path) -> tuple:
    st = p.stat()
    return (str(p.absolute()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def input_facts(path: str | Path, memo: Optional[str | Path] = None) -> InputFacts:
    """The facts of input file `path` (one sequential read, see InputFacts).

    Remembered in this process, and in folder `memo` when given (one small json per
    file, keyed by path, inode, size, mtime and ctime: a rewrite, an append, a copy or a
    same-size edit in the middle all change the key), so later runs do not read it again.
    """
    p = Path(path)
    key = _stat_key(p)
    facts = _FINGERPRINTS.get(key)
    if facts is None and memo is not None:
        facts = _read_memo(Path(memo), key)
    if facts is None:
        facts = _hash_input(p, key[2])
        if memo is not None:
            _write_memo(Path(memo), key, facts)
    _FINGERPRINTS[key] = facts
    return facts


def _memo_file(memo: Path, key: tuple) -> Path:
    return memo / f"{hashlib.sha256(key[0].encode()).hexdigest()[:24]}.json"


def _read_memo(memo: Path, key: tuple) -> Optional[InputFacts]:
    try:
        with open(_memo_file(memo, key), encoding="utf-8") as f:
            d = json.load(f)
        if d.get("key") != list(key):
            return None
        first = d["first_record"]
        return InputFacts(d["sha256"], d["size"], d["records"],
                          None if first is None else first.encode("latin-1"),
                          d["sampled"], d["sample_chars"], d["first_problem"], d["first_line"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_memo(memo: Path, key: tuple, facts: InputFacts) -> None:
    try:
        memo.mkdir(parents=True, exist_ok=True)
        first = facts.first_record
        write_json_atomic(_memo_file(memo, key), {
            "key": list(key), "sha256": facts.sha256, "size": facts.size,
            "records": facts.records, "sampled": facts.sampled,
            "sample_chars": facts.sample_chars, "first_problem": facts.first_problem,
            "first_line": facts.first_line,
            "first_record": None if first is None else first.decode("latin-1")})
    except OSError:
        pass  # an unwritable cache only costs a later run one more read


def file_fingerprint(path: str | Path, memo: Optional[str | Path] = None) -> str:
    """Content fingerprint of an input file (its sha256, the whole file however large) or
    folder (a digest of its files' fingerprints). Each file is read once and remembered
    (input_facts)."""
    p = Path(path)
    if p.is_dir():
        return digest({f.relative_to(p).as_posix(): file_fingerprint(f, memo)
                       for f in sorted(p.rglob("*")) if f.is_file()}, 64)
    return input_facts(p, memo).sha256


def _string_chars(obj: Any) -> int:
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_string_chars(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(_string_chars(v) for v in obj)
    return 0


def _hash_input(p: Path, size: int) -> InputFacts:
    """One sequential read of `p`: sha256, non-blank lines, the first line, and the string
    characters of the first SAMPLE_RECORDS records that parse as json."""
    h = hashlib.sha256()
    records = sampled = chars = lineno = 0
    first_line = 1
    first: Optional[bytes] = None
    first_problem: Optional[str] = None
    tail = b""
    with open(p, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                lines = [tail] if tail else []
            else:
                h.update(block)
                lines = (tail + block).split(b"\n")
                tail = lines.pop()
            for line in lines:
                lineno += 1
                if not line.strip():
                    continue
                records += 1
                if records == 1:
                    first = line if len(line) <= _EDGE else None
                    first_line = lineno
                if records <= SAMPLE_RECORDS and first_problem is None:
                    try:
                        chars += _string_chars(json.loads(line.decode("utf-8")))
                        sampled += 1
                    except (UnicodeDecodeError, ValueError) as exc:
                        if records == 1:
                            first_problem = type(exc).__name__
            if not block:
                break
    return InputFacts(h.hexdigest(), size, records, first, sampled, chars, first_problem,
                      first_line)


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
