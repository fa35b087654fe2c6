"""Engine(host_memory=...): the host pool in the caller's buffer (ess_config.host_memory), refused by name when the
buffer cannot hold it or cannot be written, and usable by a second engine that makes the same calls."""
import mmap

import numpy as np
import pytest

import ess

CONFIG = dict(layers=2, max_requests=2, max_context=128, topk=8, slots=16, host_bytes=1 << 20)


def test_two_engines_on_one_buffer_see_one_pool():
    region = mmap.mmap(-1, 1 << 20)
    a, b = ess.Engine(**CONFIG, host_memory=region), ess.Engine(**CONFIG, host_memory=region)
    a.admit(5, 70)
    b.admit(5, 70)
    entries = np.random.default_rng(1).integers(0, 256, (70, 656), dtype=np.uint8)
    a.write_entries(5, 1, 0, entries)
    np.testing.assert_array_equal(b.read_entries(5, 1, 0, np.empty_like(entries)), entries)
    assert a.host_layer(1) == b.host_layer(1)
    a.close()
    b.close()
    region.close()   # the engines no longer hold it


def test_a_buffer_that_cannot_hold_the_pool_is_refused():
    with pytest.raises(ess.EssError, match="host"):
        ess.Engine(**CONFIG, host_memory=mmap.mmap(-1, 8192))
    with pytest.raises(ess.InvalidArgument, match="read-only"):
        ess.Engine(**CONFIG, host_memory=bytes(1 << 20))
