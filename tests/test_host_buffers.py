"""Host-side buffers are CPU tensors whatever the default device: vLLM builds attention layers (and
so our impl's counters) under a default-device context, where a bare ``torch.zeros`` lands on that
device and ``pin_memory=True`` fails ("Only dense CPU tensors can be pinned")."""

import pytest
import torch

from vllm_ext.device_counters import DeviceCounters
from vllm_ext.host_staging import PinnedStaging

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_staging_host_side_is_cpu_under_another_default_device(device):
    default = "meta" if device == "cpu" else device
    with torch.device(default):
        s = PinnedStaging(8, torch.int32, torch.device(device))
    assert s.cpu.device.type == "cpu" and s.gpu.device.type == device
    s.np[:3] = [4, 5, 6]
    assert s.copy_to_device(3).cpu().tolist() == [4, 5, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_counters_under_another_default_device(device):
    default = "meta" if device == "cpu" else device
    with torch.device(default):
        c = DeviceCounters(3, torch.device(device))
    c.values += torch.tensor([1, 2, 3], device=device)
    c.publish()
    if device == "cuda":
        torch.cuda.synchronize()
    assert c.read() == [1, 2, 3]
