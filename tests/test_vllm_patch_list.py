"""``vllm_ext.vllm_patches.PATCHES`` is the whole list of vLLM internals SPEEDSFI changes: every
wrapper installed by ``register()`` is listed (found by the mark each wrapper carries), every listed
target is patched, each names a vLLM file that exists and a contract test that exists."""

from __future__ import annotations

import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name) if not isinstance(obj, type) or name not in obj.__dict__ \
                else obj.__dict__[name]
        return getattr(obj, "__func__", obj)          # a classmethod's function carries the mark
    raise ImportError(dotted)


def test_every_listed_patch_is_installed_and_tested():
    import vllm
    import vllm.entrypoints.cli.serve  # noqa: F401 (the CLI's hook goes in where the CLI is loaded)

    import vllm_ext
    from vllm_ext import vllm_patches
    from vllm_ext.vllm_patches import _PATCHED_ATTR, PATCHES

    vllm_ext.register()
    vllm_patches.install()          # idempotent: here for a register() that ran before the CLI loaded
    vllm_root = pathlib.Path(vllm.__file__).parent.parent
    for p in PATCHES:
        target = _resolve(p.target)
        if p.target.endswith("__reduce_ex__"):
            assert callable(target)
        else:
            assert getattr(target, _PATCHED_ATTR, False), f"{p.target} is listed but not patched"
        assert (vllm_root / p.vllm_file).is_file(), p.vllm_file
        path, _, test = p.contract_test.partition("::")
        assert f"def {test}(" in (ROOT / path).read_text(), p.contract_test
        assert _resolve(p.installed_by)


def test_every_wrapper_in_the_package_is_listed():
    """Each ``setattr(<wrapper>, _PATCHED_ATTR, True)`` in vllm_ext marks one patch: their number is
    the list's (the enum member's pickling is set another way)."""
    from vllm_ext.vllm_patches import PATCHES

    marks = 0
    for path in (ROOT / "vllm_ext").rglob("*.py"):
        marks += path.read_text().count("_PATCHED_ATTR, True)")
    # upper_stack marks one wrapper function that it installs on two model classes
    assert marks + 1 == len([p for p in PATCHES if not p.target.endswith("__reduce_ex__")])
    assert len({p.target for p in PATCHES}) == len(PATCHES)
