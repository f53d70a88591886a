"""Numbers cannot drift: every figure block of the README and ``docs/`` is what
``scripts/write_figures.py`` writes from its committed result file, names the machine, the date, the
commit and its source file; no page states a measured figure outside such a block, except in the few
paragraphs marked ``not measured`` or ``historical`` that EXEMPTIONS lists (the README in none)."""

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
    assert {"first_hour", "gpu_h200", "document_question", "sfi_path", "load_cpu", "quality_real_2k"} <= names
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


@pytest.mark.parametrize("name", sorted(write_figures.FIGURES))
def test_every_block_follows_its_files(name, monkeypatch):
    """Each block is written from its result files: change every decimal in them and the block changes."""
    read = write_figures._result_text
    before = write_figures.FIGURES[name]()
    monkeypatch.setattr(write_figures, "_result_text",
                        lambda n: re.sub(r"\b(\d+)\.(\d+)", lambda m: f"{int(m.group(1)) + 1}.{m.group(2)}", read(n)))
    assert write_figures.FIGURES[name]() != before


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


# Every paragraph exempt from the rule, where and why (scripts/write_figures.py: EXEMPT). A new mark
# fails test_every_exemption_is_listed until it is listed here: exemptions stay few and visible.
EXEMPTIONS = {
    ("docs/ALGORITHMS.md", "not measured", "the SFI paper's reported results"),
    ("docs/ALGORITHMS.md", "not measured",
     "the SPEED paper's constants, arithmetic on them and its reported results"),
    ("docs/ALGORITHMS.md", "not measured", "the CritiPrefill paper's reported results"),
    ("docs/gpu_vllm_e2e.md", "not measured", "the lent machines' stated limits (docs of the device tool)"),
    ("docs/gpu_vllm_e2e.md", "not measured", "sizes of vLLM's published CUDA wheel and of the files in it"),
    ("docs/per_request_memory.md", "not measured", "arithmetic of the sizing formula for the preset"),
    ("docs/per_request_memory.md", "not measured", "arithmetic of the page formula at two model shapes "
     "(tests/sfi/test_history_kv_spec.py checks Qwen3-4B's)"),
    ("docs/per_request_memory.md", "not measured", "arithmetic of the page formula"),
    ("docs/sfi.md", "not measured", "arithmetic of the maintenance scratch and launch counts"),
    ("docs/gpu_vllm_e2e.md", "historical",
     "sizes of the carried payloads as built on 2026-11-23; no result file holds them"),
    ("docs/performance.md", "historical",
     "the per-step times and the cProfile tables of the avx512 run's log, "
     "bench/results/cpu_decode_batch_bf16_avx512.log"),
    ("docs/performance.md", "historical",
     "the per-step times and the cProfile tables of the fp8 run's log, "
     "bench/results/cpu_decode_batch_bf16_fp8kv_avx512.log"),
}

PAGES = write_figures.documents()


def _name(path):
    return str(path.relative_to(doc_blocks.ROOT))


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_no_measured_figure_outside_a_block(path):
    stray, _ = write_figures.scan(path.read_text())
    assert not stray, (f"measured figures in {_name(path)}'s prose: {stray}; put them in a figure block "
                       "written by scripts/write_figures.py, drop them for a pointer to bench/README.md or "
                       "bench/QUALITY.md, or mark the paragraph (docs/README.md, 'Writing these pages')")


def test_the_readme_has_no_exemption():
    assert write_figures.scan((doc_blocks.ROOT / "README.md").read_text())[1] == []


def test_every_exemption_is_listed():
    found = {(_name(path), kind, why) for path in PAGES
             for _, kind, why, _ in write_figures.scan(path.read_text())[1]}
    assert found == set(EXEMPTIONS), "exemption marks differ from tests/test_figures.py EXEMPTIONS"


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_each_mark_covers_a_figure(path):
    for line, kind, why, figures in write_figures.scan(path.read_text())[1]:
        assert figures, f"{_name(path)}:{line}: the {kind!r} mark ({why}) covers no figure; remove it"


def test_the_scan_finds_figures_and_honours_marks():
    assert [f for _, f in write_figures.scan(
        "4.1 TB/s, 5.6K tokens/s, 129 µs, 78.8 MB, 2.2 GB/s, 31.1 ms/step, 5-11x; 32K x 4\n")[0]] == [
        "4.1 TB/s", "5.6K tokens/s", "129 µs", "78.8 MB", "2.2 GB/s", "31.1 ms", "11x"]
    text = ("Decode took 12.5 ms.\n\n<!-- not measured: the paper's figure -->\nThe paper reports 3.0x\n"
            "and 25 %.\n\nOurs: 2.1x.\n\n```bash\nsleep 30 s\n```\n<!-- figures: x -->\n9 ms\n<!-- /figures -->\n")
    stray, exempt = write_figures.scan(text)
    assert stray == [(1, "12.5 ms"), (7, "2.1x")]
    assert exempt == [(3, "not measured", "the paper's figure", ["3.0x", "25 %"])]


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (15, 17), (17, 17), (74, 75), (1, 1)])
def test_clopper_pearson_interval(k, n):
    lo, hi = write_figures.clopper_pearson(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    # the interval of k / n mirrors the one of (n - k) / n
    lo2, hi2 = write_figures.clopper_pearson(n - k, n)
    assert lo == pytest.approx(1 - hi2, abs=1e-9) and hi == pytest.approx(1 - lo2, abs=1e-9)
    if k == n:                          # closed form: P(all n | p) = p^n = 2.5 %
        assert lo == pytest.approx(0.025 ** (1 / n), abs=1e-9)
    if 0 < k < n:                       # each end leaves exactly 2.5 % of its tail
        assert 1 - write_figures._binomial_cdf(k - 1, n, lo) == pytest.approx(0.025, abs=1e-6)
        assert write_figures._binomial_cdf(k, n, hi) == pytest.approx(0.025, abs=1e-6)
