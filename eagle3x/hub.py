"""The hub-dataset client: where a dataset named on the Hugging Face hub is read from.

No heavy import (no `datasets`, no `huggingface_hub`): the startup checks and the plan
use it. `hub_source(name, config, split)` -> `HubRef` (the commit the run reads, whether
it is cached, its examples in the split, or why it cannot be read), asked once per
process; the datasets cache is read as `datasets` lays it out
(``<org>___<name>/<config>/<version>/<commit>/dataset_info.json``); the hub's API is
asked for the commit with urllib (HF_ENDPOINT, HF_TOKEN; never when HF_HUB_OFFLINE or
HF_DATASETS_OFFLINE is set).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class HubRef:
    """A hub dataset as this run reads it: the commit (None: unknown), from the local cache
    or the hub, its examples in the split (from the cache's dataset_info.json), and why it
    cannot be read."""

    revision: Optional[str]
    cached: bool
    records: Optional[int] = None
    problem: Optional[str] = None


_HUB: Dict[tuple, HubRef] = {}


def hub_source(name: str, config: Optional[str], split: str) -> HubRef:
    """Where hub dataset `name` is read from: the hub's current commit when it answers
    (from the cache when that commit is cached), else the newest cached copy; asked once
    per process."""
    key = (name, config, split)
    if key not in _HUB:
        sha, why = hub_revision(name)
        cached = hub_cached(name, config, split)
        if sha is not None:
            have = cached is not None and cached[0] == sha
            _HUB[key] = HubRef(sha, have, cached[2] if have else None)
        elif cached is not None:
            _HUB[key] = HubRef(cached[0], True, cached[2])
        else:
            _HUB[key] = HubRef(None, False, problem=(
                f"not in the local datasets cache ({hub_cache_dir()}) and {why}"))
    return _HUB[key]


_UPPER_UPPER = re.compile(r"([A-Z]+)([A-Z][a-z])")
_LOWER_UPPER = re.compile(r"([a-z\d])([A-Z])")


def snake_name(name: str) -> str:
    """`datasets.naming.camelcase_to_snakecase`: how a dataset's name is spelled in the
    datasets cache (a test holds the two equal)."""
    name = _UPPER_UPPER.sub(r"\1_\2", name)
    name = _LOWER_UPPER.sub(r"\1_\2", name)
    return name.lower()


def hub_cache_dir() -> Path:
    """The datasets cache (HF_DATASETS_CACHE, else $HF_HOME/datasets)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "datasets"


def _hub_root(name: str) -> Path:
    ns, _, short = name.rpartition("/")
    base = snake_name(short)
    return hub_cache_dir() / (f"{ns}___{base}" if ns else base)


def hub_cached_config(name: str) -> Optional[str]:
    configs = sorted(p.name for p in _hub_root(name).glob("*") if p.is_dir())
    return "default" if "default" in configs else (configs[0] if configs else None)


def hub_cached(name: str, config: Optional[str], split: str
               ) -> Optional[Tuple[str, Path, Optional[int]]]:
    """(revision, folder, examples in the split) of the newest cached copy of hub dataset
    `name` (config) holding `split`, or None. The datasets cache keeps ``<org>___<name>/<config>/<version>/<hash>``,
    the hash being the hub commit it was made from."""
    config = config or hub_cached_config(name)
    if config is None:
        return None
    found = []
    for info in _hub_root(name).glob(f"{config}/*/*/dataset_info.json"):
        try:
            splits = json.loads(info.read_text(encoding="utf-8")).get("splits") or {}
        except (OSError, ValueError):
            continue
        if split in splits:
            n = (splits[split] or {}).get("num_examples")
            found.append((info.stat().st_mtime, info.parent.name, info.parent,
                          n if isinstance(n, int) else None))
    if not found:
        return None
    _, revision, folder, n = max(found)
    return revision, folder, n


def hub_cached_folder(name: str, config: Optional[str], revision: str) -> Optional[Path]:
    """The cached copy of hub dataset `name` (config) made from commit `revision`."""
    config = config or hub_cached_config(name)
    found = sorted(_hub_root(name).glob(f"{config}/*/{revision}/dataset_info.json"))
    return found[-1].parent if found else None


def hub_offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_revision(name: str, timeout: float = 5.0) -> Tuple[Optional[str], Optional[str]]:
    """(commit sha of hub dataset `name`, None) from the hub's API, or (None, why not)."""
    if hub_offline():
        return None, "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)"
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    req = urllib.request.Request(f"{endpoint}/api/datasets/{name}")
    token = os.environ.get("HF_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            sha = json.loads(r.read().decode("utf-8")).get("sha")
    except urllib.error.HTTPError as exc:
        return None, f"the hub answers HTTP {exc.code} for it"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"the hub cannot be reached ({getattr(exc, 'reason', exc)})"
    return (sha, None) if isinstance(sha, str) else (None, "the hub's answer has no revision")
