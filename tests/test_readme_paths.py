"""What a newcomer reads is there: the README is a short map whose
every page is reachable from it; every repository path the README and ``docs/`` cite (in backticks
or as links) exists; and no file points outside the repository."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
# backticked words that look like paths but are not files of the repository
NOT_PATHS = {".png", "l_cut/L", "retained/context"}
# built by set-up or on a GPU machine, or text the papers' authors wrote (not in the repository)
NOT_IN_REPO = ("http", "-", "/", "~", ".cache/", ".venv/", ".gpu_payload/", "papers/", "$")


def _cited_paths(text: str) -> set[str]:
    words = set(re.findall(r"`([A-Za-z0-9_./\-]+)`", text))
    return {w for w in words - NOT_PATHS
            if ("/" in w or re.search(r"\.(py|md|sh|yaml|json|txt|png|toml)$", w))
            and not w.startswith(NOT_IN_REPO)}


def _links(text: str) -> set[str]:
    return {m for m in re.findall(r"\]\(([^)#\s]+)\)", text) if not m.startswith("http")}


def test_every_path_the_readme_cites_exists():
    readme = (ROOT / "README.md").read_text()
    cited = _cited_paths(readme)
    assert len(cited | _links(readme)) > 15          # the patterns find the README's paths
    missing = sorted(p for p in cited | _links(readme) if not (ROOT / p).exists())
    assert not missing, f"README cites paths that are not in the repository: {missing}"


# pages that cite files inside vLLM's wheel (its own paths, not this repository's)
CITE_VLLM = {"gpu_vllm_e2e.md"}


def test_every_path_the_docs_cite_exists():
    missing = []
    for page in DOCS:
        text = page.read_text()
        cited = set() if page.name in CITE_VLLM else _cited_paths(text)
        missing += [f"{page.name}: {p}" for p in sorted(cited)
                    if not (ROOT / p).exists() and not (page.parent / p).exists()]
        missing += [f"{page.name}: {p}" for p in sorted(_links(text)) if not (page.parent / p).exists()]
    assert not missing, missing


def test_the_readme_is_a_map_that_reaches_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {(ROOT / p).resolve() for p in _links(readme)}
    unreached = [p.name for p in DOCS if p.resolve() not in linked]
    assert not unreached, f"docs pages the README does not link: {unreached}"
    for page in ("bench/README.md", "bench/QUALITY.md"):
        assert (ROOT / page).resolve() in linked, page
    index = _links((ROOT / "docs" / "README.md").read_text())
    assert {p.name for p in DOCS} - {"README.md"} <= {pathlib.Path(p).name for p in index}


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in [*ROOT.glob("scripts/*"), *ROOT.glob("vllm_ext/**/*.py"), *ROOT.glob("bench/*.py"),
                 ROOT / "README.md", *ROOT.glob("bench/*.md"), *DOCS]:
        if path.is_file() and re.search(r"\.\./shared|/work/shared", path.read_text(errors="replace")):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
