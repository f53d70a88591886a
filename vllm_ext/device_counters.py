"""Counters that live on the device and are read without synchronising the host (the metrics'
device-side half; ``vllm_ext.metrics`` is the host side). Torch only."""

from __future__ import annotations

import threading

import torch


class DeviceCounters:
    """Counters accumulated on the device and read without synchronising: after each step the
    builder issues a non-blocking copy into pinned memory and records an event; readers take the
    latest copy whose event has completed. Readers may run on another thread (the metrics' flusher):
    a lock keeps a copy from being queued into the buffer a reader is cloning."""

    def __init__(self, n: int, device: torch.device):
        self.values = torch.zeros(n, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._host = [torch.zeros(n, dtype=torch.int64, device="cpu", pin_memory=True)
                          for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            self._issued = [False, False]
            self._next = 0
            self._last = torch.zeros(n, dtype=torch.int64, device="cpu")
            self._lock = threading.Lock()

    def publish(self) -> None:
        """Queue a copy of the current values (call after the step's device updates)."""
        if not self._cuda:
            return
        with self._lock:
            i = self._next
            if self._issued[i] and not self._events[i].query():
                return                   # the previous copy into this buffer is still in flight
            self._host[i].copy_(self.values, non_blocking=True)
            self._events[i].record()
            self._issued[i] = True
            self._next = 1 - i

    def read(self) -> list[int]:
        if not self._cuda:
            return self.values.tolist()
        with self._lock:
            for i in sorted(range(2), key=lambda j: j != 1 - self._next):   # newest first
                if self._issued[i] and self._events[i].query():
                    self._last = self._host[i].clone()
                    break
            return self._last.tolist()
