"""The docs: the reference pages are what the code generates now, the site builds with
`mkdocs build --strict`, and the README stays a quickstart whose links resolve."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3x import docs
from eagle3x.config import schema

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_what_the_code_generates():
    stale = docs.stale()
    assert not stale, (f"{', '.join(stale)} differ from the code: regenerate with "
                       f"`{docs.COMMAND}` and commit the pages")


def test_a_changed_page_is_seen_as_stale(tmp_path):
    for name in docs.PAGES:
        (tmp_path / name).write_text(docs.render(name), encoding="utf-8")
    assert docs.stale(tmp_path) == []
    page = tmp_path / "config.md"
    page.write_text(page.read_text().replace("`data.split`", "`data.splits`"))
    assert docs.stale(tmp_path) == [str(page)]


@dataclasses.dataclass
class _NewSection:  # no docstring: dataclass makes one up from the signature
    key: int = schema.documented(1, "a key")


@dataclasses.dataclass
class _WithSection(schema.Eagle3xConfig):
    """The root, with a section of no docstring."""

    new: _NewSection = dataclasses.field(default_factory=_NewSection)


def test_every_config_key_has_a_doc_and_a_key_without_one_is_refused(monkeypatch):
    page = docs.config_page()
    for f in dataclasses.fields(schema.DataConfig):
        if f.name != "fields":
            assert f"| `data.{f.name}` |" in page

    @dataclasses.dataclass
    class Extra(schema.Eagle3xConfig):
        new_key: int = 3  # the old style: a `#` comment no tool reads

    monkeypatch.setattr(schema, "Eagle3xConfig", Extra)
    with pytest.raises(docs.UndocumentedKey, match="`new_key` has no doc"):
        docs.config_page()
    assert docs.main(["--check"]) == 1

    monkeypatch.setattr(schema, "Eagle3xConfig", _WithSection)
    with pytest.raises(docs.UndocumentedKey, match="section `new`"):
        docs.config_page()


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """A broken link, a missing anchor or a page left out of the nav fails the build (the
    dev extra installs mkdocs and mkdocs-material)."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_readme_is_a_quickstart_whose_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for marker in ("<!-- ci:install -->\n```bash\n", "<!-- ci:test -->\n```bash\n"):
        assert marker in readme, f"{marker.splitlines()[0]} (read by .ci/run) must precede a bash block"
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_readme_and_getting_started_show_the_same_demo_output():
    """The demo's console is shown twice; one copy must not drift from the other."""
    def demo(text: str) -> str:
        start = text.index("```\n[...][eagle3x][INFO] - building the embedded tiny verifier")
        return text[start:text.index("```\n", start + 4)]

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert demo(readme) == demo(index)
