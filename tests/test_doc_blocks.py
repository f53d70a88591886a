"""Every shell and Python block of the README and ``docs/`` says whether it runs on the CPU build
(``tests/doc_blocks.py``); every block is valid shell / Python and names repository paths that
exist. The runnable ones are run in ``tests/e2e/test_doc_commands.py``, the README's examples in
``tests/e2e/test_readme_examples.py``."""

from __future__ import annotations

import subprocess

import pytest

from tests import doc_blocks

CODE = [b for b in doc_blocks.all_blocks() if b.is_code]


def test_every_code_block_is_marked():
    unmarked = [b.id for b in CODE if b.kind is None]
    assert not unmarked, f"mark each block runnable or check-only (tests/doc_blocks.py): {unmarked}"
    unknown = [(b.id, b.kind) for b in CODE if b.kind not in (*doc_blocks.KINDS, "check-only")]
    assert not unknown, unknown
    assert any(b.kind == "runnable: server" for b in CODE)
    doc_blocks.setup_script()                                                 # exactly one


def test_the_readme_has_its_examples():
    """A server with one client and an offline program, each once, in the README only."""
    readme = [b.kind for b in doc_blocks.blocks(doc_blocks.ROOT / "README.md")]
    assert [k for k in readme if k and k.startswith("example")] == ["example: server", "example: client",
                                                                    "example: offline"]
    elsewhere = [b.id for b in CODE if b.kind and b.kind.startswith("example") and b.path != "README.md"]
    assert not elsewhere, elsewhere
    server = next(b for b in CODE if b.kind == "example: server")
    client = next(b for b in CODE if b.kind == "example: client")
    assert doc_blocks.clients_of(doc_blocks.blocks(doc_blocks.ROOT / "README.md"), server) == [client]
    offline = next(b for b in CODE if b.kind == "example: offline")
    assert offline.lang == "python" and "__main__" in offline.code   # vLLM starts its engine in another process


@pytest.mark.parametrize("block", CODE, ids=lambda b: b.id)
def test_block_is_valid_and_names_existing_paths(block):
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    else:
        r = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    missing = sorted(p for p in doc_blocks.repository_paths(block.code)
                     if not (doc_blocks.ROOT / p).exists())
    assert not missing, missing


def test_every_client_follows_a_server():
    for doc in doc_blocks.documents():
        seen = set()
        for b in doc_blocks.blocks(doc):
            if b.kind in doc_blocks.SERVERS:
                seen.add(doc_blocks.client_kind(b))
            if b.kind in ("runnable: client", "example: client"):
                assert b.kind in seen, b.id
    for b in CODE:
        if b.kind in doc_blocks.SERVERS:
            assert doc_blocks.served_model(b.code)
