"""The vLLM adapter driven as the sparse MLA backend's index group drives HiSparse's runtime:
begin_forward per step, the new KV written at slot_mapping(), swap_in per layer with decode
tokens as rows (MTP: T rows per request), valid counts and caller-owned outputs."""
import numpy as np
import pytest

import ess
from ess.integrations.vllm import HiSparseRuntime
from lru_model import EngineModel
from mock_engine import ENTRY, World, check_rows

LAYERS, K, CTX, POOL = 2, 16, 300, 6


@pytest.mark.parametrize("T,slots", [(1, 20), (3, 56)])
def test_swap_in_matches_the_model_and_the_full_cache(T, slots):
    latent = [np.zeros((POOL, slots + T, ENTRY), np.uint8) for _ in range(LAYERS)]  # [blocks, block_rows, E]
    engine = ess.Engine(layers=LAYERS, max_requests=POOL, max_context=CTX, topk=K, query_tokens=T, slots=slots,
                        reserve_newest=True, warmup_windows=2, latent=latent)
    flat = [l.reshape(-1, ENTRY) for l in latent]
    runtime = HiSparseRuntime(engine, max_num_reqs=4)
    world = World(seed=10 + T, layers=LAYERS, topk=K, query_tokens=T, max_context=CTX)
    model = EngineModel(LAYERS, slots, T, reserve_newest=True, warmup_windows=2)
    rows_of = {}
    for row, n in [(4, 70), (1, 100), (2, 45)]:
        entries = world.new_request(row, n)
        windows = world.warmup_topk(row, 3)
        runtime.add_request(row, n, entries=entries, warmup_topk=windows)
        model.admit(row)
        model.warmup(row, windows)
        rows_of[row] = row
    out = np.empty((4 * T, K), np.int32)
    counts_out = np.empty((4 * T,), np.int64)
    for step in range(8):
        order = sorted(rows_of)
        for r in order:
            world.length[r] += T
        padded = len(order) + 1  # one padded request row (-1)
        request_rows = np.array(order + [-1], np.int32)
        seq_lens = np.array([world.length[r] for r in order] + [0], np.int32)
        runtime.begin_forward(request_rows, seq_lens)
        slots_out = runtime.slot_mapping().reshape(padded, T)
        assert (slots_out[-1] == -1).all()
        for b, r in enumerate(order):
            for t in range(T):
                for layer in range(LAYERS):
                    flat[layer][slots_out[b, t]] = world.full[r][layer][world.length[r] - T + t]
        batch = [(r, r) for r in order] + [(None, None)]
        for layer in range(LAYERS):
            rows = np.stack([world.query_rows(r) for r in order] + [np.full((T, K), -1, np.int64)])
            topk = rows.reshape(padded * T, K).astype(np.int32)
            req_id_per_token = np.repeat(np.arange(padded), T)
            physical, valid = runtime.swap_in(req_id_per_token=req_id_per_token, logical_topk_indices=topk,
                                              block_table=None, block_size=64, return_valid_counts=True,
                                              attention_indices_out=out[: padded * T],
                                              valid_counts_out=counts_out[: padded * T])
            assert physical is not None and np.shares_memory(physical, out)
            np.testing.assert_array_equal(valid, (topk >= 0).sum(axis=1) * (np.repeat(request_rows, T) >= 0))
            check_rows(world, model, rows, flat, layer, batch, physical.reshape(padded, T, K))
        with pytest.raises(ess.InvalidArgument, match="layers"):
            runtime.swap_in(req_id_per_token=req_id_per_token, topk_indices=topk)
        if step == 3:
            runtime.free(2)
            model.release(2)
            del rows_of[2]


def test_swap_in_refuses_an_unknown_token_order():
    engine = ess.Engine(layers=1, max_requests=2, max_context=64, topk=8, query_tokens=2, slots=16,
                        reserve_newest=True)
    runtime = HiSparseRuntime(engine, 2)
    runtime.add_request(0, 10)
    runtime.begin_forward(np.array([0], np.int32), np.array([12], np.int32))
    topk = np.full((2, 8), -1, np.int32)
    with pytest.raises(ess.InvalidArgument, match="req_id_per_token"):
        runtime.swap_in(req_id_per_token=np.array([0, 1]), topk_indices=topk)
    with pytest.raises(ess.InvalidArgument, match="one of"):
        runtime.swap_in(req_id_per_token=np.array([0, 0]), topk_indices=topk, logical_topk_indices=topk)
    physical = runtime.swap_in(req_id_per_token=np.array([0, 0]), topk_indices=topk)
    assert (physical == -1).all()
