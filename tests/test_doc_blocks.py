"""Every shell and Python block of the README and ``docs/`` says whether it runs on the CPU build
(``tests/doc_blocks.py``); every block is valid shell / Python and names repository paths that
exist. The runnable ones are run in ``tests/e2e/test_doc_commands.py``."""

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
    assert any(b.kind == "runnable" and b.lang == "python" for b in CODE)   # the offline snippet
    assert any(b.kind == "runnable: server" for b in CODE)
    doc_blocks.setup_script()                                                 # exactly one


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
        seen_server = False
        for b in doc_blocks.blocks(doc):
            seen_server |= b.kind == "runnable: server"
            if b.kind == "runnable: client":
                assert seen_server, b.id
    for b in CODE:
        if b.kind == "runnable: server":
            assert doc_blocks.served_model(b.code)
