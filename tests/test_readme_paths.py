"""What a newcomer reads is there (issue 26 item 4): every repository path the README cites in
backticks exists, and every file under ``docs/`` and ``scripts/`` that the code cites is in the
repository (no path outside it)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# backticked words that look like paths but are not files of the repository
NOT_PATHS = {".png", "l_cut/L"}


def _cited_paths(text: str) -> set[str]:
    words = set(re.findall(r"`([A-Za-z0-9_./\-]+)`", text))
    return {w for w in words - NOT_PATHS
            if ("/" in w or re.search(r"\.(py|md|sh|yaml|json|txt|png|toml)$", w))
            and not w.startswith(("http", "-", "/", "~", ".cache/", ".venv/"))}   # built by set-up


def test_every_path_the_readme_cites_exists():
    readme = (ROOT / "README.md").read_text()
    cited = _cited_paths(readme)
    assert len(cited) > 30                           # the pattern finds the README's paths
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"README cites paths that are not in the repository: {missing}"


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in [*ROOT.glob("scripts/*"), *ROOT.glob("vllm_ext/**/*.py"), *ROOT.glob("bench/*.py"),
                 ROOT / "README.md", *ROOT.glob("bench/*.md")]:
        if path.is_file() and re.search(r"\.\./shared|/work/shared", path.read_text(errors="replace")):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
