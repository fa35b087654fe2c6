"""Streams and events as an engine's adapter needs them, for a CUDA device (torch.cuda's) and for the
host (CPU: work runs when it is launched, streams and events are orderless stand-ins).

The adapter launches its device work through `launch(fn)`: on CUDA `fn` runs at once and its torch
ops and ESS calls enqueue on the current stream; on the host it simply runs. Everything the
adapter orders, it orders through these objects, so a test can hand it a device that records
the order (python/tests/test_sglang_streams.py) and check it without a GPU."""
from __future__ import annotations

import contextlib


class CudaDevice:
    is_cuda = True

    def __init__(self, device):
        import torch
        self.torch = torch
        self.device = torch.device(device)

    def current_stream(self):
        return self.torch.cuda.current_stream(self.device)

    def Stream(self):
        return self.torch.cuda.Stream(self.device)

    def Event(self):
        return self.torch.cuda.Event()

    def stream(self, s):
        return self.torch.cuda.stream(s)

    @staticmethod
    def launch(fn):
        fn()

    @staticmethod
    def handle(stream):
        return stream.cuda_stream


class _HostEvent:
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _HostStream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class HostDevice:
    """The CPU: synchronous, as SGLang's own CPU device module is."""
    is_cuda = False

    def __init__(self, device="cpu"):
        self.device = device
        self._current = _HostStream()

    def current_stream(self):
        return self._current

    def Stream(self):
        return _HostStream()

    def Event(self):
        return _HostEvent()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def launch(fn):
        fn()

    @staticmethod
    def handle(stream):
        return None


def for_device(device):
    """The device object for SGLang's `device` string ("cuda", "cuda:1", "cpu")."""
    return CudaDevice(device) if str(device).startswith("cuda") else HostDevice(str(device))
