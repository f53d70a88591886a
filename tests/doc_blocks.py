"""The fenced shell and Python blocks of the README and ``docs/`` and how each may be run.

A block is marked by an HTML comment on the line before its fence:

* ``<!-- runnable -->``: runs as written on the CPU build against the real model (set-up built it);
* ``<!-- runnable: tiny -->``: the same against a tiny checkpoint (the real model's path replaced);
* ``<!-- runnable: setup -->``: the environment every other block of the README runs after;
* ``<!-- runnable: server -->``: a ``vllm serve`` command, started and waited for; the
  ``<!-- runnable: client -->`` blocks after it (same file) run against it;
* ``<!-- example: server -->``, ``<!-- example: client -->``, ``<!-- example: offline -->``: the
  README's examples, whose output ``tests/e2e/test_readme_examples.py`` checks (not only that they
  run): a ``vllm serve`` command and the client blocks (shell or Python) after it, and an offline
  Python program;
* ``<!-- check-only: REASON -->``: cannot run on a CPU machine (or takes minutes); its syntax and the
  repository paths it names are checked only.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHELL_LANGS = ("bash", "sh", "shell", "console")
KINDS = ("runnable", "runnable: tiny", "runnable: setup", "runnable: server", "runnable: client",
         "example: server", "example: client", "example: offline")
SERVERS = ("runnable: server", "example: server")
REAL_MODEL = ".cache/real_model/SmolLM2-135M-Instruct"
_MARK = re.compile(r"^<!--\s*(runnable(?::\s*\w+)?|example:\s*\w+|check-only:[^>]*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str          # relative to the repository root
    line: int          # the fence's line, 1-based
    lang: str
    kind: str | None   # one of KINDS, "check-only", or None (unmarked)
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_code(self) -> bool:
        return self.lang in SHELL_LANGS or self.lang == "python"


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: pathlib.Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        mark = _MARK.match(lines[start - 1]) if start > 0 else None
        kind = None
        if mark:
            word, _, arg = mark.group(1).partition(":")
            kind = "check-only" if word == "check-only" else word.strip() + (f": {arg.strip()}" if arg else "")
        out.append(Block(str(path.relative_to(ROOT)), start + 1, lang, kind, "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for doc in documents() for b in blocks(doc)]


def setup_script() -> str:
    """The README's environment block: what every runnable block runs after."""
    found = [b for b in blocks(ROOT / "README.md") if b.kind == "runnable: setup"]
    if len(found) != 1:
        raise ValueError(f"the README needs exactly one runnable: setup block, found {len(found)}")
    return found[0].code


def one_line(code: str) -> str:
    """A shell block's continuation lines joined (``\\`` + newline)."""
    return re.sub(r"\\\n\s*", " ", code)


def served_model(code: str) -> str:
    m = re.search(r"vllm serve\s+(\S+)", one_line(code))
    if not m:
        raise ValueError("a server block must start `vllm serve MODEL ...`")
    return m.group(1)


def client_kind(server: Block) -> str:
    """The kind of the client blocks a server block answers (``runnable: client`` or ``example: client``)."""
    return server.kind.split(":")[0] + ": client"


def clients_of(all_of_file: list[Block], server: Block) -> list[Block]:
    """The client blocks of ``server``'s family that follow it, up to the next server block of its file."""
    out, after = [], False
    for b in all_of_file:
        if b == server:
            after = True
        elif after and b.kind in SERVERS:
            break
        elif after and b.kind == client_kind(server):
            out.append(b)
    return out


_REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|docker|configs|bench|docs|vllm_ext|tests|models|requirements)"
                        r"/[\w./-]*[\w/])")


def repository_paths(code: str) -> set[str]:
    """Paths in a block that must be in the repository (set-up's outputs, ``.venv`` and ``.cache``,
    are not)."""
    return {m.rstrip("/") for m in _REPO_PATH.findall(code) if "*" not in m}
