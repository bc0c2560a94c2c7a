"""Files shipped inside the package: the bundled sample conversations."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def resource(name: str) -> Path:
    """The path of a bundled file, e.g. ``resource("sample_conversations.jsonl")``."""
    return ROOT / name
