"""One host pool per node: two processes, as two attention-TP ranks of vLLM, replay the same decode (test_vllm_replay's,
upstream's handles and index group over ESS's runtime) with vLLM's host pool in one shared-memory region (as vLLM
0.33.0 shares it: v1/hisparse/runtime.py allocate_hisparse_host_pools, a SharedOffloadRegion; here
ess.integrations._shared_pool.SharedHostPool stands in for it) and each rank's ESS engine on it as foreign pages.
Rank 0 plays vLLM's row mirror and writes every entry; rank 1 writes none, so its rows holding the full cache's
bytes show that ESS reads the one pool. The mutation test gives rank 1 a region of its own (a pool per rank): its
replay then fails."""
import multiprocessing
import os
import traceback

import pytest

import ess
from ess.integrations import _shared_pool as shared
import test_vllm_replay as replay

TIMEOUT = 120


def region_name(private):
    return f"ess-test-{os.getpid()}-{int(private)}"


def rank_main(rank, name, barrier, results, private):
    try:
        def wait():
            barrier.wait(TIMEOUT)
        if rank == 0:
            pool = shared.SharedHostPool(name, replay.HOST_BYTES, create=True)
            wait()
        else:
            wait()
            pool = shared.SharedHostPool(name + "-own" if private else name, replay.HOST_BYTES, create=private)
        try:
            replay.test_decode_replay_matches_the_model_and_the_full_cache(
                3, 56, True, False, region=pool.buffer, mirror=rank == 0, barrier=wait)
            wait()   # rank 0 keeps the region until rank 1 is done
        finally:
            import gc
            gc.collect()   # the engine (and its view of the region) goes before the region
            pool.close()
        results.put((rank, "ok"))
    except BaseException:
        barrier.abort()
        results.put((rank, traceback.format_exc()))


def run_ranks(private):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    name = region_name(private)
    procs = [ctx.Process(target=rank_main, args=(r, name, barrier, results, private)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=4 * TIMEOUT) for _ in procs)
    for p in procs:
        p.join(TIMEOUT)
    return out


def test_two_ranks_share_one_host_pool():
    out = run_ranks(private=False)
    assert out == {0: "ok", 1: "ok"}, "\n".join(f"rank {r}:\n{v}" for r, v in out.items())
    assert not os.path.exists(os.path.join("/dev/shm", region_name(False))), "the region outlived its ranks"


def test_a_pool_per_rank_fails_the_reader():
    """Mutation: rank 1 on a pool of its own, which no one writes."""
    out = run_ranks(private=True)
    assert out[1] != "ok" and "AssertionError" in out[1], out[1]
    assert not any(os.path.exists(os.path.join("/dev/shm", region_name(True) + tail)) for tail in ("", "-own"))


def test_a_pool_larger_than_the_free_ram_is_refused_before_anything_exists():
    with pytest.raises(ess.InvalidArgument, match="GiB of RAM is available"):
        shared.check_host_memory(100 * 2**30, available=64 * 2**30)
    shared.check_host_memory(60 * 2**30, available=64 * 2**30)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ess.InvalidArgument, match="shared host pool"):
        shared.SharedHostPool(f"ess-test-huge-{os.getpid()}", shared.available_host_memory() * 2, create=True)
    assert set(os.listdir("/dev/shm")) == before
