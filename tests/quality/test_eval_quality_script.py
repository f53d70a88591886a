"""``scripts/eval_quality.py`` end to end on a small grid (real vLLM, CPU build, a subprocess each).

Token-id prompts on the committed retrieval model, and text prompts sized with a BPE tokenizer (the
path real models take on a GPU) on a tiny random-weight Qwen3: the JSON, the table and the plots are
written, dense agrees with itself, a covering SFI budget agrees with dense, and the retained fraction
of a sparse budget is what its configuration implies.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "eval_quality.py")


def _run(args, out_dir):
    env = dict(os.environ)
    env["SPEEDSFI_FORCE_TORCH_KERNELS"] = "1"     # the engines run the PyTorch twins on CPU
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out_dir), "--name", "q"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out_dir / "q.json") as f:
        return json.load(f), proc.stdout


def test_token_id_suite(tmp_path):
    configs = json.dumps([{"name": "sfi_cover", "speedsfi": {"sfi": {"enabled": True, "k": 1024,
                                                                    "n_recent": 64}}},
                          {"name": "sfi_k64", "speedsfi": {"sfi": {"enabled": True, "k": 64,
                                                                  "n_recent": 64}}}])
    data, stdout = _run(["--tasks", "niah_single,kv_lookup", "--lengths", "512", "--depths", "0.5,1",
                         "--per-cell", "1", "--seed", "7", "--configs", configs], tmp_path)
    by_name = {c["name"]: c for c in data["configs"]}
    assert list(by_name) == ["dense", "sfi_cover", "sfi_k64"]
    dense, cover, sparse = by_name["dense"], by_name["sfi_cover"], by_name["sfi_k64"]
    assert data["meta"]["n_samples"] == 4 and len(dense["samples"]) == 4
    assert data["meta"]["filler"] == "plain"                # the default haystack
    assert dense["agreement_with_dense"] == 1.0 and dense["read_fraction"] == 1.0
    assert dense["accuracy"] == 1.0                     # the committed model at a trained length
    assert cover["agreement_with_dense"] == 1.0 and cover["fast_retained_fraction"] == 1.0
    # fast steps keep sink 4 + k 64 + recent 64 of ~513 positions
    assert 0.2 < sparse["fast_retained_fraction"] < 0.3
    assert sparse["read_fraction"] > sparse["fast_retained_fraction"]   # slow steps read everything
    assert sparse["per_length"]["512"]["fast_steps"] > 0
    for c in data["configs"]:
        assert set(c["cells"]) == {f"{t}|512|{d}" for t in ("niah_single", "kv_lookup")
                                   for d in (0.5, 1.0)}
    for suffix in (".md", "_acc_vs_retained.png", "_heatmaps.png"):
        assert (tmp_path / f"q{suffix}").stat().st_size > 0
    assert "| sfi_k64 |" in (tmp_path / "q.md").read_text() and "| sfi_k64 |" in stdout
    # --report rewrites the same tables from the JSON alone (no engine)
    before = (tmp_path / "q.md").read_text()
    (tmp_path / "q.md").unlink()
    proc = subprocess.run([sys.executable, SCRIPT, "--report", str(tmp_path / "q.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "q.md").read_text() == before


def test_text_suite_with_a_bpe_tokenizer(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    data, _ = _run(["--model", model, "--text", "--tasks", "niah_single,kv_lookup",
                    "--lengths", "600", "--depths", "0.5", "--per-cell", "1", "--ks", "32",
                    "--n-recent", "32", "--no-plots"], tmp_path)
    assert data["meta"]["prompts"] == "text"
    names = [c["name"] for c in data["configs"]]
    assert names == ["dense", "sfi_k32"]
    for c in data["configs"]:
        for s in c["samples"]:
            assert s["length"] == 600 and isinstance(s["output"], str)
    sparse = data["configs"][1]
    assert 0.0 < sparse["fast_retained_fraction"] < 0.5
    assert data["configs"][0]["agreement_with_dense"] == 1.0
