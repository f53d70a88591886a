"""The kernels, the method logic and the request state import without vLLM (the GPU machines have
torch and Triton but no vLLM)."""

import subprocess
import sys

TORCH_ONLY = [
    "vllm_ext", "vllm_ext.config", "vllm_ext.metrics", "vllm_ext.request_state",
    "vllm_ext.kernels.paged_reference", "vllm_ext.kernels.two_segment_decode",
    "vllm_ext.kernels.dense_decode_evidence", "vllm_ext.kernels.gather_compact",
    "vllm_ext.kernels.merge_state", "vllm_ext.kernels.sfi_selector",
    "vllm_ext.kernels.block_representatives", "vllm_ext.kernels.block_sparse_prefill",
    "vllm_ext.kernels.sfi_selector_torch", "vllm_ext.methods.sfi.schedule", "vllm_ext.methods.sfi.triggers",
    "vllm_ext.methods.sfi.step_plan", "vllm_ext.methods.sfi.slot_tables", "vllm_ext.methods.critiprefill.plan",
    "vllm_ext.device_counters", "vllm_ext.kernels.sfi_plan", "vllm_ext.kernels.quest_pages",
    "vllm_ext.methods.sfi.runtime", "vllm_ext.methods.sfi.path",
    "vllm_ext.methods.critiprefill.slots", "vllm_ext.methods.critiprefill.path",
    "vllm_ext.method_slots", "vllm_ext.backend.request_table",
]


def test_torch_only_modules_import_without_vllm():
    code = ("import sys\nsys.modules['vllm'] = None   # any import of vllm now fails\n"
            + "".join(f"import {m}\n" for m in TORCH_ONLY) + "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_vllm_glue_really_needs_vllm():
    """The guard above is meaningful: the glue modules do fail without vLLM."""
    code = "import sys\nsys.modules['vllm'] = None\nimport vllm_ext.backend.impl\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "vllm" in out.stderr
