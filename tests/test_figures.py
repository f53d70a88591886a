"""Numbers cannot drift (issue 38 item 4): every figure block of the README and ``docs/`` is what
``scripts/write_figures.py`` writes from its committed result file, names the machine, the date, the
commit and its source file; the README states no measured figure outside such a block."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests import doc_blocks

_spec = importlib.util.spec_from_file_location("write_figures", doc_blocks.ROOT / "scripts" / "write_figures.py")
write_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(write_figures)

BLOCKS = [(path, m) for path in write_figures.documents()
          for m in write_figures.BLOCK.finditer(path.read_text())]


def test_the_readme_and_docs_have_figure_blocks():
    names = {m.group(2) for _, m in BLOCKS}
    assert {"first_hour", "gpu_h200", "document_question"} <= names
    assert names <= set(write_figures.FIGURES)


@pytest.mark.parametrize("path,match", BLOCKS, ids=lambda x: getattr(x, "name", None) or x.group(2))
def test_figure_block_equals_its_result_file(path, match):
    written = match.group(3)
    expected = write_figures.FIGURES[match.group(2)]()
    assert written == expected, (f"{path.name}: the {match.group(2)!r} figures differ from their file; "
                                 "run `python scripts/write_figures.py`")
    assert re.search(r"20\d\d-\d\d-\d\d", written)                        # the date
    assert re.search(r"commit[^;]*\b[0-9a-f]{7}\b", written)              # the commit
    assert re.search(r"AMD EPYC|H100|H200", written)                      # the machine
    assert "source: `bench/results/" in written


def test_a_changed_result_is_caught(monkeypatch):
    text = (doc_blocks.ROOT / "README.md").read_text()
    assert write_figures.render(text) == text
    monkeypatch.setattr(write_figures, "_load", lambda name: _bumped(name))
    assert write_figures.render(text) != text


def _bumped(name):
    import json

    d = json.loads((doc_blocks.ROOT / write_figures.RESULTS / name).read_text())
    if name == "first_hour.json":
        d["demo"]["wall_s"] += 60
    elif name == "vllm_e2e_h200.json":
        d["rows"][0]["tpot_ms"] *= 1.1
    elif name == "document_question_smollm2.json":
        d["results"]["dense"]["correct"] -= 1
    return d


# a number with a unit of time, speed or size, or a percentage: a measurement
_MEASURED = re.compile(r"\b\d+(?:[.,]\d+)?\s?(?:ms|s|min|x|%|GiB|MiB|tokens/s)(?![\w-])")


def test_the_readme_states_no_figure_outside_a_block():
    text = (doc_blocks.ROOT / "README.md").read_text()
    text = write_figures.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)                     # commands, not figures
    found = _MEASURED.findall(text)
    assert not found, f"measured figures in the README's prose (put them in a figure block): {found}"
