"""Host memory for a host pool: the check against the RAM available (vLLM's rule for its own pool) and one region
that the engines of several local processes map (Engine(host_memory=...), the C ABI's ess_config.host_memory)."""
from __future__ import annotations

import mmap
import os
from typing import Optional

from .._errors import InvalidArgument


def available_host_memory() -> int:
    """Bytes of RAM the kernel says a new allocation can take (/proc/meminfo MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(nbytes: int, what: str = "ESS's host pool", available: Optional[int] = None):
    """Refuses, by name, a host pool the machine's free RAM cannot hold (vLLM's own check: 95 % of
    MemAvailable), before anything is allocated."""
    available = available_host_memory() if available is None else available
    if nbytes > 0.95 * available:
        raise InvalidArgument(f"{what} needs {nbytes / 2**30:.2f} GiB but {available / 2**30:.2f} GiB of RAM is "
                              "available: ask for a smaller pool")


class SharedHostPool:
    """One host-pool region per node, which every local rank's engine maps (Engine(host_memory=pool.buffer)): a
    file in /dev/shm that the creating rank sizes (after check_host_memory) and removes; the others open it."""

    def __init__(self, name: str, nbytes: int, create: bool, directory: str = "/dev/shm"):
        if "/" in name or not name:
            raise InvalidArgument(f"SharedHostPool: name {name!r} must be a plain file name")
        size = -(-int(nbytes) // 4096) * 4096
        self.path, self.created = os.path.join(directory, name), bool(create)
        if create:
            check_host_memory(size, f"the shared host pool {self.path}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
        else:
            fd = os.open(self.path, os.O_RDWR)
            if os.fstat(fd).st_size < size:
                os.close(fd)
                raise InvalidArgument(f"SharedHostPool: {self.path} holds fewer than the {size} bytes expected")
        try:
            self.buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self):
        """The creator removes the file; the region is unmapped (close the engines on it first: a mapping still
        in use raises BufferError and stays)."""
        if self.created and os.path.exists(self.path):
            os.unlink(self.path)
        self.buffer.close()
