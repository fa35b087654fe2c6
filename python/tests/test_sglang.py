"""The SGLang adapter driven exactly as the NSA backend's decode path drives HiSparse: admission,
map_last_loc_to_buffer before each forward (the model then writes the new KV where it says),
swap_in_selected_pages per layer; padded graph positions, int32 and int64 ids, MTP; every row
checked against the independent model and every byte against the full cache."""
import types

import numpy as np
import pytest

import ess
from ess.integrations.sglang import HiSparseCoordinator
from lru_model import EngineModel
from mock_engine import ENTRY, World, check_rows

LAYERS, K, CTX, POOL = 3, 16, 400, 8


def make(T, slots, max_batch=6):
    latent = [np.zeros((POOL * (slots + T), ENTRY), np.uint8) for _ in range(LAYERS)]
    engine = ess.Engine(layers=LAYERS, max_requests=POOL, max_context=CTX, topk=K, query_tokens=T, slots=slots,
                        reserve_newest=True, warmup_windows=4, latent=latent)
    return engine, latent, HiSparseCoordinator(engine, max_batch)


@pytest.mark.parametrize("T,slots", [(1, 24), (2, 40)])
def test_decode_loop_matches_the_model_and_the_full_cache(T, slots):
    engine, latent, coord = make(T, slots)
    world = World(seed=T, layers=LAYERS, topk=K, query_tokens=T, max_context=CTX)
    model = EngineModel(LAYERS, slots, T, reserve_newest=True, warmup_windows=4)
    live = {}  # req_pool_idx -> Req

    def admit(idx, n):
        req = types.SimpleNamespace(req_pool_idx=idx, seqlen=n, rid=f"r{idx}")
        entries = world.new_request(idx, n)
        windows = world.warmup_topk(idx, 6)
        coord.admit_request_direct(req, entries=entries, warmup_topk=windows)
        model.admit(idx)
        model.warmup(idx, windows)
        live[idx] = req

    for idx, n in [(5, 120), (0, 60), (3, 200), (7, 33)]:
        admit(idx, n)
    rng = np.random.default_rng(7)
    for step in range(12):
        if step == 4:  # one finishes, another arrives at its slot
            coord.request_finished(live.pop(3))
            model.release(3)
            admit(3, 90)
        if step == 8:
            admit(1, 150)
        order = sorted(live)
        rng.shuffle(order)
        real = len(order)
        padded = real + (1 if step % 3 == 0 else 0)  # a CUDA-graph batch padded with a copy of position 0
        for idx in order:
            world.length[idx] += T
        req_pool_indices = np.array(order + order[: padded - real], np.int64)
        seq_lens = np.array([world.length[i] for i in req_pool_indices], np.int64)
        coord.num_real_reqs = real if padded > real else None
        reserved = coord.map_last_loc_to_buffer(seq_lens, None, req_pool_indices, seq_lens.copy())
        reserved = reserved.reshape(padded, T)
        for b, idx in enumerate(order):  # the model's KV write of this step's T new entries
            for t in range(T):
                for layer in range(LAYERS):
                    latent[layer][reserved[b, t]] = world.full[idx][layer][world.length[idx] - T + t]
        assert (reserved[real:] == -1).all()
        batch = [(idx, idx) for idx in order] + [(None, None)] * (padded - real)
        for layer in range(LAYERS):
            rows = np.stack([world.query_rows(idx) for idx in order] +
                            [np.zeros((T, K), np.int64)] * (padded - real))
            topk = rows.reshape(padded * T, K).astype(np.int64 if step % 2 else np.int32)
            physical = coord.swap_in_selected_pages(req_pool_indices, seq_lens, topk, layer)
            assert physical.dtype == np.int32 and physical.shape == topk.shape
            check_rows(world, model, rows, latent, layer, batch, physical.reshape(padded, T, K),
                       coord.session.counts[:padded])
    coord.wait_for_pending_backup()
    for idx in list(live):  # every entry written back reached the host pool
        n = world.length[idx]
        back = engine.read_entries(idx, 1, 0, np.empty((n, ENTRY), np.uint8))
        np.testing.assert_array_equal(back, world.full[idx][1][:n])
        coord.request_finished(live.pop(idx))
    assert engine.stats().requests == 0


def test_refusals_leave_the_state_unchanged():
    engine, latent, coord = make(1, 24)
    world = World(seed=3, layers=LAYERS, topk=K, query_tokens=1, max_context=CTX)
    req = types.SimpleNamespace(req_pool_idx=2, seqlen=50)
    coord.admit_request_direct(req, entries=world.new_request(2, 50))
    with pytest.raises(ess.InvalidArgument, match="request 2 is already admitted"):
        coord.admit_request_direct(types.SimpleNamespace(req_pool_idx=2, seqlen=10))
    # Warm-up ids past the prompt: refused, and the request is not left admitted.
    bad = np.full((LAYERS, 1, K), 60, np.int32)
    with pytest.raises(ess.InvalidArgument):
        coord.admit_request_direct(types.SimpleNamespace(req_pool_idx=4, seqlen=50), warmup_topk=bad)
    assert engine.stats().requests == 1
    # A length that is not the request's + T: refused before anything moves.
    with pytest.raises(ess.InvalidArgument, match="length 53"):
        coord.map_last_loc_to_buffer(None, None, np.array([2]), np.array([53]))
    assert engine.request(2) == (2, 50)
    with pytest.raises(ess.InvalidArgument, match="holds no admitted request"):
        coord.map_last_loc_to_buffer(None, None, np.array([6]), np.array([51]))
    coord.map_last_loc_to_buffer(None, None, np.array([2]), np.array([51]))
    with pytest.raises(ess.InvalidArgument, match="51"):  # an id at the length
        coord.swap_in_selected_pages(None, None, np.array([[51] + [-1] * (K - 1)], np.int32), 0)
    with pytest.raises(ess.InvalidArgument, match="shape"):
        coord.swap_in_selected_pages(None, None, np.zeros((2, K), np.int32), 0)
    physical = coord.swap_in_selected_pages(None, None, np.array([[50, 3] + [-1] * (K - 2)], np.int32), 0)
    assert physical[0, 0] == engine.info.reserved_row(2) and physical[0, 2] == -1
    with pytest.raises(ess.InvalidArgument, match="reserve_newest"):
        HiSparseCoordinator(ess.Engine(layers=1, max_requests=2, max_context=64, topk=8, slots=8), 2)
