"""The README's examples (``<!-- example: ... -->`` blocks, ``tests/doc_blocks.py``) run as written
on the CPU build against the real model, after the README's environment block, and print what the
README says they print: the answer with the ``sfi`` preset and with SFI off for that request, both
the document's locker number, and the share of the KV the sparse run's fast steps read, under half.
The server's share is also the one its ``/metrics`` shows once the client has finished: the client
read the request's counters after they had all landed. The only change made to what the reader types
is the server's port (a free one instead of 8000)."""

from __future__ import annotations

import re
import time

import pytest

from tests import doc_blocks
from tests.e2e.served import stop_process_group
from tests.e2e.test_doc_commands import _healthy, _run, _serve
from tests.e2e.served import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

README = doc_blocks.ROOT / "README.md"
EXAMPLES = {b.kind: b for b in doc_blocks.blocks(README) if b.kind and b.kind.startswith("example")}
_PRINTED = re.compile(r"^expected (\d+)\nsfi preset: (['\"])(.*)\2 \((.*)\)\nSFI off:    (['\"])(.*)\5$", re.M)


@pytest.fixture(scope="module")
def question():
    model = doc_blocks.ROOT / doc_blocks.REAL_MODEL
    if not (model / "config.json").exists():
        pytest.skip(f"the real model is not built ({doc_blocks.REAL_MODEL}: scripts/setup_env.sh)")
    from transformers import AutoTokenizer

    from vllm_ext.quality.document import make_document_question

    length = int(re.search(r"make_document_question\(.*length=(\d+)\)", EXAMPLES["example: offline"].code).group(1))
    tok = AutoTokenizer.from_pretrained(str(model))
    q = make_document_question(tok, length=length)
    positions = 8192                                    # SmolLM2-135M-Instruct's max_position_embeddings
    assert 2312 < q.prompt_tokens(tok) < positions - 64  # above the preset's min_len: SFI decodes sparse
    return q


def _check_printed(out: str, q) -> float:
    """The printed answers are both right; returns the share of the KV the sparse run read."""
    m = _PRINTED.search(out)
    assert m, f"the example printed something else:\n{out[-3000:]}"
    expected, sparse, read, dense = m.group(1), m.group(3), m.group(4), m.group(6)
    assert expected == q.answer
    assert q.correct(sparse), f"the preset's answer {sparse!r} misses {q.answer}"
    assert q.correct(dense), f"SFI off answered {dense!r}, not {q.answer}"
    share = re.match(r"([0-9.]+)% of the KV on (\d+) fast steps \((\d+) slow", read)
    assert share, f"no fast step in the sparse run: {read!r}"
    assert int(share.group(2)) > 0
    assert float(share.group(1)) < 50
    return float(share.group(1)) / 100


def test_offline_example(question, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(EXAMPLES["example: offline"].code)
    r = _run(f"python {script}", timeout=1200)
    assert r.returncode == 0, f"the offline example failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    _check_printed(r.stdout, question)


def test_server_example(question, tmp_path):
    from vllm_ext.tools.kv_read import metrics_counters

    server, client = EXAMPLES["example: server"], EXAMPLES["example: client"]
    assert doc_blocks.clients_of(doc_blocks.blocks(README), server) == [client]
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = _serve(server, port, log)
    try:
        deadline = time.monotonic() + 600
        while not _healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"vllm serve did not come up:\n{(tmp_path / 'serve.log').read_text()[-6000:]}"
            time.sleep(1)
        code = client.code.replace("localhost:8000", f"localhost:{port}")
        if client.lang == "python":
            (tmp_path / "client.py").write_text(code)
            code = f"python {tmp_path / 'client.py'}"
        r = _run(code, timeout=1200)
        assert r.returncode == 0, f"the client failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        share = _check_printed(r.stdout, question)
        time.sleep(3)                                   # anything still to land would have by now
        total = metrics_counters(f"http://127.0.0.1:{port}")
        assert total["slots.released"] == 2             # the two requests, nothing else
        # the client's share is the whole sparse request's: SFI off reads no fast step
        assert share == pytest.approx(total["sfi.fast_retained_tokens"] / total["sfi.fast_context_tokens"],
                                      abs=6e-4)
    finally:
        stop_process_group(proc)
