"""The Python API on the C ABI: construction and binding checks (by name, nothing created or
changed), the step against the independent model, lossless bytes, write-back, the planner, and
torch tensors where Debian's python3-torch is installed."""
import json

import numpy as np
import pytest

import ess
from lru_model import EngineModel

ENTRY = 656


def small(**kw):
    args = dict(layers=2, max_requests=3, max_context=128, topk=8, slots=16)
    args.update(kw)
    return ess.Engine(**args)


def test_library_facts():
    assert ess.ABI_VERSION == 1 and ess.__version__.count(".") == 2
    assert isinstance(ess.cuda_built(), bool) and ess.cuda_device_count() >= 0


@pytest.mark.parametrize("kw,message", [
    (dict(slots=16, ratio=0.5), "slots = 16 and ratio = 0.5 are both given"),
    (dict(slots=0), "neither slots nor ratio"),
    (dict(slots=4), "4 slots per request-layer cannot hold"),
    (dict(max_context=0), "max_context = 0"),
    (dict(policy="lfu"), "policy = 'lfu'"),
    (dict(backend="tpu"), "backend = 'tpu'"),
    (dict(max_requests=2.5), "max_requests = 2.5: an integer is expected"),
    (dict(model={"num_hidden_layers": 2}), "config.model_json"),
    (dict(model="/nonexistent/config.json"), "/nonexistent/config.json"),
    (dict(latent=[np.zeros((48, ENTRY), np.uint8)]), "1 latent buffers for 2 layers"),
    (dict(latent=[np.zeros((47, ENTRY), np.uint8)] * 2), "holds 47 rows"),
    (dict(latent=[np.zeros((48, 655), np.uint8)] * 2), "spans 655 bytes"),
])
def test_bad_configurations_are_refused_by_name(kw, message):
    with pytest.raises(ess.InvalidArgument, match=message.replace("(", r"\(").replace("[", r"\[")):
        small(**kw)


def test_unavailable_backend():
    if ess.cuda_device_count() > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(ess.Unavailable):
        small(backend="cuda")


def test_the_cpu_backend_takes_a_lifecycle_stream_and_ignores_it():
    e = small()
    for stream in (0, 0x1234, None):   # 0: the legacy default stream; None: each call waits (the default)
        e.set_lifecycle_stream(stream)
        row = e.admit(4, 20)
        e.extend(4, 3)
        assert e.request(4) == (row, 23)
        e.release(4)   # the host pages at once: nothing is pending on a CPU
        assert e.stats().requests == 0 and e.stats().host_bytes_used == 0


def test_ratio_sets_the_slots():
    e = small(slots=0, ratio=0.2, max_context=100)
    assert e.info.slots == 20 and e.info.rows_per_request == 20


def test_the_cpu_backend_holds_no_device_memory():
    assert small().device_bytes() == 0


def test_bindings_check_dtype_shape_contiguity_and_device():
    e = small()
    row = e.admit(1, 50)
    rows, lengths = np.array([row], np.int32), np.array([50], np.int32)
    topk, phys = np.arange(8, dtype=np.int32).reshape(1, 1, 8), np.zeros((1, 1, 8), np.int32)
    with pytest.raises(ess.InvalidArgument, match="topk has dtype code 0 bits 64: int32 is needed"):
        e.bind_step(rows, topk.astype(np.int64), lengths, phys)
    with pytest.raises(ess.InvalidArgument, match=r"physical has shape \[1, 1, 7\]"):
        e.bind_step(rows, topk, lengths, phys[..., :7].copy())
    with pytest.raises(ess.InvalidArgument, match="topk is not contiguous"):
        e.bind_step(rows, np.zeros((1, 1, 16), np.int32)[..., ::2], lengths, phys)
    with pytest.raises(ess.InvalidArgument, match="has no __dlpack__"):
        e.bind_step([row], topk, lengths, phys)
    with pytest.raises(ess.InvalidArgument, match="go together"):
        e.bind_step(rows, topk, lengths, phys, resident=phys.copy())
    b = e.bind_step(rows, topk.reshape(1, 8), lengths, phys.reshape(1, 8))  # [B x T, K] is accepted too
    b.step(0)
    with pytest.raises(ess.InvalidArgument, match=r"batch 2 outside \[0, 1\]"):
        b.step(0, 2)
    e.close()
    with pytest.raises(ess.InvalidArgument, match="closed"):
        b.step(0)


def test_steps_match_the_model_and_are_lossless():
    T, K, slots, L = 2, 8, 24, 2
    latent = [np.zeros((3 * (slots + T), ENTRY), np.uint8) for _ in range(L)]
    e = small(query_tokens=T, slots=slots, reserve_newest=True, latent=latent)
    model = EngineModel(L, slots, T, reserve_newest=True)
    rng = np.random.default_rng(1)
    full = rng.integers(0, 256, (L, 128, ENTRY), dtype=np.uint8)
    row = e.admit(9, 40, row=2)
    model.admit(row)
    for layer in range(L):
        e.write_entries(9, layer, 0, full[layer, :40])
    rows, lengths = np.array([row], np.int32), np.zeros(1, np.int32)
    topk, phys = np.zeros((1, T, K), np.int32), np.zeros((1, T, K), np.int32)
    counts = np.zeros((1, 2), np.int32)
    step = e.bind_step(rows, topk, lengths, phys, counts=counts)
    wb = e.bind_write_back(rows, lengths)
    n = 40
    for s in range(6):
        e.extend(9, T)
        n += T
        lengths[0] = n
        for layer in range(L):
            for t in range(T):  # the model writes the new entries into the reserved rows
                latent[layer][e.info.reserved_row(row, t)] = full[layer, n - T + t]
            for t in range(T):
                topk[0, t] = rng.choice(n, K, replace=False)
            before = e.stats()
            step.step(layer)
            expected, hits, misses = model.step(row, layer, n, topk[0].tolist())
            np.testing.assert_array_equal(phys[0], expected)
            assert tuple(counts[0]) == (hits, misses)
            assert e.stats().misses - before.misses == misses
            for t in range(T):
                for k in range(K):
                    assert latent[layer][phys[0, t, k]].tobytes() == full[layer, topk[0, t, k]].tobytes()
                    assert e.read_row(layer, int(phys[0, t, k])) == full[layer, topk[0, t, k]].tobytes()
            wb.write_back(layer)
    back = e.read_entries(9, 1, 0, np.empty((n, ENTRY), np.uint8))
    np.testing.assert_array_equal(back, full[1, :n])


def test_regions_put_each_requests_rows_in_its_blocks_losslessly():
    # Another engine's paged cache (blocks of 8 rows): each request's 26 rows in 4 blocks it is given
    # in a shuffled order; the model's rows (row x rows_per_request + slot) mapped through them here.
    T, K, slots, L, block_rows, region = 2, 8, 24, 2, 8, 4
    latent = [np.zeros((20, block_rows, ENTRY), np.uint8) for _ in range(L)]
    with pytest.raises(ess.InvalidArgument, match="do not fit a region of 3 blocks of 8 rows"):
        small(query_tokens=T, slots=slots, reserve_newest=True, latent=latent, region_blocks=3)
    e = small(query_tokens=T, slots=slots, reserve_newest=True, latent=latent, region_blocks=region)
    assert e.info.region_blocks == region
    with pytest.raises(ess.InvalidArgument, match="has regions"):
        e.info.reserved_row(0)
    model = EngineModel(L, slots, T, reserve_newest=True)
    rng = np.random.default_rng(3)
    full = {i: rng.integers(0, 256, (L, 128, ENTRY), dtype=np.uint8) for i in (4, 9)}
    blocks = [int(b) for b in rng.permutation(20)]
    placed = {4: blocks[:region], 9: blocks[region:2 * region]}
    rows = {}
    for i in (4, 9):
        rows[i] = e.admit(i, 40)
        model.admit(rows[i])
        assert e.buffer_row(rows[i], 0) == -1   # no region yet
        with pytest.raises(ess.InvalidArgument, match="no region yet"):
            e.warmup(i, np.full((L, 1, K), -1, np.int32))
        for layer in range(L):
            e.write_entries(i, layer, 0, full[i][layer, :40])
        e.place(i, placed[i])
        e.warmup(i, np.full((L, 1, K), -1, np.int32))
    with pytest.raises(ess.InvalidArgument, match="lies in the region of request 4"):
        e.place(9, placed[4][:1] + placed[9][1:])

    def at(i, p):  # the model's row p of request i, in its region
        s = p - rows[i] * model.rows_per_request
        return placed[i][s // block_rows] * block_rows + s % block_rows

    batch = np.array([rows[4], rows[9]], np.int32)
    lengths = np.zeros(2, np.int32)
    topk, phys = np.zeros((2, T, K), np.int32), np.zeros((2, T, K), np.int32)
    step = e.bind_step(batch, topk, lengths, phys)
    wb = e.bind_write_back(batch, lengths)  # the newest entries reach the host pool from the reserved rows
    n = 40
    for s in range(5):
        if s == 3:  # request 9 moves to other blocks: its LRU starts empty there
            placed[9] = blocks[2 * region:3 * region]
            e.place(9, placed[9])
            model.admit(rows[9])
        n += T
        for b, i in enumerate((4, 9)):
            e.extend(i, T)
            lengths[b] = n
            for layer in range(L):
                for t in range(T):  # the model writes the new entries into the reserved rows
                    r = e.buffer_row(rows[i], slots + t)
                    assert r == at(i, rows[i] * model.rows_per_request + slots + t)
                    latent[layer].reshape(-1, ENTRY)[r] = full[i][layer, n - T + t]
        for layer in range(L):
            for b in range(2):
                for t in range(T):
                    topk[b, t] = rng.choice(n, K, replace=False)
            step.step(layer)
            for b, i in enumerate((4, 9)):
                expected, _, _ = model.step(rows[i], layer, n, topk[b].tolist())
                np.testing.assert_array_equal(phys[b], [[at(i, p) for p in q] for q in expected])
                for t in range(T):
                    for k in range(K):
                        got = latent[layer].reshape(-1, ENTRY)[phys[b, t, k]]
                        assert got.tobytes() == full[i][layer, topk[b, t, k]].tobytes()
            wb.write_back(layer)
    e.close()


def test_a_buffer_in_two_parts_holds_heads_and_tails_at_their_places():
    # C4-like pages of 16 rows: each page its 16 heads of 576 bytes, then their 16 tails of 80 (the
    # 656-byte entry's last 80), as strided numpy views of one page array per layer.
    T, K, slots, L, head, tail, rows_in_page = 2, 8, 24, 2, 576, 80, 16
    page = rows_in_page * ENTRY
    pages = (3 * (slots + T) + rows_in_page - 1) // rows_in_page
    storage = [np.zeros(pages * page, np.uint8) for _ in range(L)]
    heads = [np.lib.stride_tricks.as_strided(s, (pages, rows_in_page, head), (page, head, 1)) for s in storage]
    tails = [np.lib.stride_tricks.as_strided(s[rows_in_page * head:], (pages, rows_in_page, tail), (page, tail, 1))
             for s in storage]
    e = small(query_tokens=T, slots=slots, reserve_newest=True, latent=heads, latent_tail=tails, split_bytes=head,
              tail_bytes=tail)
    assert (e.info.split_bytes, e.info.tail_bytes, e.info.tail_block_rows) == (head, tail, rows_in_page)

    def row_bytes(layer, p):
        at = (p // rows_in_page) * page
        return (storage[layer][at + (p % rows_in_page) * head:][:head].tobytes()
                + storage[layer][at + rows_in_page * head + (p % rows_in_page) * tail:][:tail].tobytes())

    rng = np.random.default_rng(4)
    full = rng.integers(0, 256, (L, 128, ENTRY), dtype=np.uint8)
    row = e.admit(5, 40, row=1)
    for layer in range(L):
        e.write_entries(5, layer, 0, full[layer, :40])
    rows, lengths = np.array([row], np.int32), np.zeros(1, np.int32)
    topk, phys = np.zeros((1, T, K), np.int32), np.zeros((1, T, K), np.int32)
    step = e.bind_step(rows, topk, lengths, phys)
    wb = e.bind_write_back(rows, lengths)
    n = 40
    for _ in range(4):
        e.extend(5, T)
        n += T
        lengths[0] = n
        for layer in range(L):
            for t in range(T):  # the model writes the new entries into the reserved rows, in two parts
                p = e.info.reserved_row(row, t)
                at = (p // rows_in_page) * page
                storage[layer][at + (p % rows_in_page) * head:][:head] = full[layer, n - T + t, :head]
                storage[layer][at + rows_in_page * head + (p % rows_in_page) * tail:][:tail] = full[layer, n - T + t, head:]
            for t in range(T):
                topk[0, t] = rng.choice(n, K, replace=False)
            step.step(layer)
            for t in range(T):
                for k in range(K):
                    want = full[layer, topk[0, t, k]].tobytes()
                    assert row_bytes(layer, int(phys[0, t, k])) == want
                    assert e.read_row(layer, int(phys[0, t, k])) == want
            wb.write_back(layer)
    np.testing.assert_array_equal(e.read_entries(5, 0, 0, np.empty((n, ENTRY), np.uint8)), full[0, :n])
    with pytest.raises(ess.InvalidArgument, match="latent tail buffer of layer 0 has shape"):
        small(query_tokens=T, slots=slots, reserve_newest=True, latent=heads, latent_tail=tails, split_bytes=head,
              tail_bytes=tail - 8)


def test_minimax_m3s_k_and_v_in_two_tensors_are_entries_of_its_sparse_layers():
    """The shipped MiniMax-M3 config: the engine's layers are its 57 sparse layers, an entry one KV head's key then
    value (512 bytes in bf16); with K and V in two tensors (as SGLang keeps them) every row read back is the token's
    key then value."""
    from pathlib import Path
    config = Path(__file__).resolve().parents[2] / "configs" / "models" / "minimax-m3.json"
    e = ess.Engine(model=config, max_requests=1, max_context=256, topk=8, slots=16)
    assert (e.info.layers, e.info.entry_bytes, e.info.topk) == (57, 512, 8)
    L, K, slots = 2, 8, 16
    rows = 2 * (slots + 1)
    keys = [np.zeros((rows, 256), np.uint8) for _ in range(L)]
    values = [np.zeros((rows, 256), np.uint8) for _ in range(L)]
    e = ess.Engine(model=config, layers=L, max_requests=2, max_context=256, topk=K, slots=slots, reserve_newest=True,
                   latent=keys, latent_tail=values, split_bytes=256, tail_bytes=256)
    rng = np.random.default_rng(7)
    full = rng.integers(0, 256, (L, 64, 512), dtype=np.uint8)
    row = e.admit(4, 40, row=1)
    for layer in range(L):
        e.write_entries(4, layer, 0, full[layer, :40])
    e.warmup(4, np.full((L, 1, K), -1, np.int32))
    r, n = np.array([row], np.int32), np.array([40], np.int32)
    topk, phys = np.zeros((1, 1, K), np.int32), np.zeros((1, 1, K), np.int32)
    step = e.bind_step(r, topk, n, phys)
    for layer in range(L):
        topk[0, 0] = rng.choice(39, K, replace=False)
        step.step(layer)
        for k in range(K):
            p = int(phys[0, 0, k])
            want = full[layer, topk[0, 0, k]]
            assert keys[layer][p].tobytes() + values[layer][p].tobytes() == want.tobytes()


def test_whole_requests_read_in_place_and_survive_demotion():
    """Adaptive residency through the Python API: request 9 whole (its rows, the newest in the reserved rows, nothing
    fetched), demoted when two more requests need rows; every row it reads holds its token's entry before and after;
    the statistics count it."""
    T, K, slots, L = 2, 8, 16, 2
    latent = [np.zeros((4 * (slots + T), ENTRY), np.uint8) for _ in range(L)]
    e = small(max_requests=4, query_tokens=T, slots=slots, reserve_newest=True, residency="adaptive",
              whole_headroom=0, latent=latent)
    rng = np.random.default_rng(3)
    full = rng.integers(0, 256, (L, 128, ENTRY), dtype=np.uint8)
    row = e.admit(9, 40)
    for layer in range(L):
        e.write_entries(9, layer, 0, full[layer, :40])
    e.warmup(9, np.stack([[rng.choice(40, K, replace=False) for _ in range(2)] for _ in range(L)]).astype(np.int32))
    whole, rows_of = e.residency(9)
    assert whole and rows_of[0] == row and len(rows_of) == 3
    rows, lengths = np.array([row], np.int32), np.zeros(1, np.int32)
    topk, phys = np.zeros((1, T, K), np.int32), np.zeros((1, T, K), np.int32)
    counts = np.zeros((1, 2), np.int32)
    step = e.bind_step(rows, topk, lengths, phys, counts=counts)
    wb = e.bind_write_back(rows, lengths)
    n = 40
    for s in range(6):
        if s == 3:  # two more requests: the last finds no free row and demotes request 9
            e.admit(10, 10)
            e.admit(11, 10)
            assert e.residency(9) == (False, [row])
        e.extend(9, T)
        n += T
        lengths[0] = n
        for layer in range(L):
            for t in range(T):  # the model writes the new entries into the reserved rows
                latent[layer][e.info.reserved_row(row, t)] = full[layer, n - T + t]
            for t in range(T):
                topk[0, t] = rng.choice(n, K, replace=False)
            step.step(layer)
            for t in range(T):
                for k in range(K):
                    tok, p = int(topk[0, t, k]), int(phys[0, t, k])
                    assert latent[layer][p].tobytes() == full[layer, tok].tobytes()
                    if s < 3 and tok < n - T:
                        assert p == rows_of[tok // slots] * e.info.rows_per_request + tok % slots
            if s < 3:
                assert tuple(counts[0]) == (0, 0)
            wb.write_back(layer)
    st = e.stats()
    assert (st.demotions, st.whole_requests) == (1, 2)
    assert st.swap_launches == 3 * L and st.whole_steps == 3 * L and st.sparse_steps == 3 * L
    with pytest.raises(ess.InvalidArgument, match="residency whole needs reserve_newest"):
        small(residency="whole")


def test_query_groups_serve_steps_larger_than_the_pool():
    T, K, slots = 4, 8, 10  # below T x K = 32
    e = small(query_tokens=T, slots=slots)
    rng = np.random.default_rng(3)
    full = rng.integers(0, 256, (2, 100, ENTRY), dtype=np.uint8)
    row = e.admit(4, 100)
    for layer in range(2):
        e.write_entries(4, layer, 0, full[layer])
    rows, lengths = np.array([row], np.int32), np.array([100], np.int32)
    topk, phys = np.zeros((1, T, K), np.int32), np.zeros((1, T, K), np.int32)
    step = e.bind_step(rows, topk, lengths, phys)
    splits = 0
    for s in range(6):
        for t in range(T):
            topk[0, t] = rng.choice(100 if s % 2 else 12, K, replace=False)  # odd steps rarely overlap
        bounds = e.query_groups(rows, topk, lengths)
        assert bounds[0] == 0 and bounds[-1] == T and bounds == sorted(set(bounds))
        splits += len(bounds) > 2
        for a, b in zip(bounds, bounds[1:]):
            assert len(set(topk[0, a:b].ravel().tolist())) <= slots
            step.step_group(0, a, b)
            assert (phys[0, :a] == -1).all() and (phys[0, b:] == -1).all()
            for t in range(a, b):
                for k in range(K):
                    assert e.read_row(0, int(phys[0, t, k])) == full[0, topk[0, t, k]].tobytes()
    assert splits >= 3
    with pytest.raises(ess.InvalidArgument, match="more than its 10 slots"):
        step.step(0)
    with pytest.raises(ess.InvalidArgument, match=r"query group \[2, 2\)"):
        step.step_group(0, 2, 2)


def test_shared_prompt_prefixes():
    e = small(max_requests=3, max_context=400)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1000, 300).astype(np.int32)
    full = rng.integers(0, 256, (2, 300, ENTRY), dtype=np.uint8)
    e.admit(1, 300)
    for layer in range(2):
        e.write_entries(1, layer, 0, full[layer])
    assert e.publish(1, prompt) == 4  # 4 whole pages of 64 tokens
    row, reused = e.admit_cached(2, prompt)
    assert reused == 256
    e.admit_shared(3, 300, 1, 200)
    for layer in range(2):
        e.write_entries(2, layer, 256, full[layer, 256:])
        e.write_entries(3, layer, 200, full[layer, 200:])
    for rid in (2, 3):
        np.testing.assert_array_equal(e.read_entries(rid, 1, 0, np.empty((300, ENTRY), np.uint8)), full[1])
    with pytest.raises(ess.InvalidArgument, match="read-only"):
        e.write_entries(2, 0, 0, full[0, :1])
    st = e.stats()
    assert st.host_bytes_unshared == 3 * 2 * 5 * 64 * ENTRY
    assert st.host_bytes_shared == 2 * 4 * 64 * ENTRY
    assert st.host_bytes_used < st.host_bytes_unshared
    e.release(1)
    e.release(2)
    e.release(3)
    assert e.stats().host_bytes_retained == 2 * 4 * 64 * ENTRY  # the published prefix, until space is needed
    with pytest.raises(ess.InvalidArgument, match="prefix 500 tokens must be within"):
        e.admit(4, 300)
        e.admit_shared(5, 300, 4, 500)


def test_refused_calls_change_nothing():
    e = small()
    e.admit(1, 50)
    before = (e.stats(), e.request(1))
    with pytest.raises(ess.InvalidArgument, match="10 entries from token 45 outside its 50 tokens"):
        e.write_entries(1, 0, 45, np.zeros((10, ENTRY), np.uint8))
    with pytest.raises(ess.InvalidArgument, match="exceeds max_context"):
        e.extend(1, 1000)
    with pytest.raises(ess.InvalidArgument, match="not admitted"):
        e.release(2)
    with pytest.raises(ess.InvalidArgument, match=r"windows has shape \[2, 1, 7\]"):
        e.warmup(1, np.zeros((2, 1, 7), np.int32))
    with pytest.raises(ess.InvalidArgument, match="all 3 rows are taken"):
        for i in range(2, 6):
            e.admit(i, 10)
    e.release(2)
    e.release(3)
    assert (e.stats(), e.request(1)) == before


def test_truncate_takes_back_unaccepted_draft_tokens():
    e = small(query_tokens=2, reserve_newest=True)
    e.admit(1, 50)
    e.extend(1, 2)
    e.write_entries(1, 0, 50, np.full((2, ENTRY), 7, np.uint8))
    e.truncate(1, 51)
    assert e.request(1)[1] == 51
    with pytest.raises(ess.InvalidArgument, match=r"outside \[49, 51\]"):
        e.truncate(1, 48)
    e.extend(1, 2)   # what comes back after a truncate is zeroed
    out = e.read_entries(1, 0, 50, np.empty((3, ENTRY), np.uint8))
    assert (out[0] == 7).all() and (out[1:] == 0).all()
    with pytest.raises(ess.InvalidArgument, match="needs reserve_newest"):
        f = small(query_tokens=2, slots=16)
        f.admit(1, 50)
        f.extend(1, 2)
        f.truncate(1, 51)


def test_host_pages_are_where_the_layout_says():
    """A transfer backend writes a request's pages of every layer at host_layer(l) + page x page_bytes (one page
    list for all layers); the engine reads those bytes, and a step serves them."""
    import ctypes
    e = small()
    h = e.host_layout()
    assert (h.layers, h.page_tokens, h.entry_bytes, h.page_bytes) == (2, 64, ENTRY, 64 * ENTRY)
    assert h.layer_bytes == h.pages_per_layer * h.page_bytes
    e.admit(4, 30)             # holds a page below request 5's
    e.admit(5, 100)
    pages = e.host_pages(5)
    assert len(pages) == 2 and len(set(pages)) == 2
    rng = np.random.default_rng(3)
    want = rng.integers(0, 256, (2, 100, ENTRY), dtype=np.uint8)
    for layer in range(2):
        base = e.host_layer(layer)
        for t in range(100):
            ctypes.memmove(base + pages[t // 64] * h.page_bytes + (t % 64) * ENTRY, want[layer, t].ctypes.data, ENTRY)
    for layer in range(2):
        assert (e.read_entries(5, layer, 0, np.empty((100, ENTRY), np.uint8)) == want[layer]).all()
        assert (e.read_entries(4, layer, 0, np.empty((30, ENTRY), np.uint8)) == 0).all()
    with pytest.raises(ess.InvalidArgument, match="unknown request 9"):
        e.host_pages(9)
    with pytest.raises(ess.InvalidArgument, match=r"layer 2 out of \[0, 2\)"):
        e.host_layer(2)
    with pytest.raises(ess.InvalidArgument, match="request_id = 18446744073709551621"):
        e.host_pages(2**64 + 5)


@pytest.mark.parametrize("call,message", [
    (lambda e: e.write_entries(1, 2**32, 0, np.zeros((1, ENTRY), np.uint8)), "layer = 4294967296"),
    (lambda e: e.release(2**64 + 1), "request_id = 18446744073709551617"),
    (lambda e: e.extend(1, 2**63), "tokens = 9223372036854775808"),
    (lambda e: e.truncate(1, -2**63 - 1), "length = -9223372036854775809"),
    (lambda e: e.admit(2, 10, row=2**31), "row = 2147483648"),
    (lambda e: e.admit(2, 2.0), "prompt_length = 2.0"),
    (lambda e: e.request(True), "request_id = True"),
    (lambda e: e.read_row(0, 2**32), "row = 4294967296"),
    (lambda e: e.layer_data(-2**31 - 1), "layer = -2147483649"),
])
def test_integers_ctypes_would_cut_are_refused_by_name(call, message):
    """A Python int past the C type's width would be cut down by ctypes (2**32 + 1 becoming 1): refused, naming
    the argument, and nothing changes."""
    e = small()
    e.admit(1, 50)
    before = (e.request(1), e.stats())
    with pytest.raises(ess.InvalidArgument, match=message.replace("+", r"\+").replace(".", r"\.")):
        call(e)
    assert (e.request(1), e.stats()) == before
    e.extend(np.int64(1), np.int32(2))  # numpy's integers are integers
    assert e.request(1)[1] == 52


@pytest.mark.parametrize("kw,message", [
    (dict(max_requests=2**32 + 3), "max_requests = 4294967299"),
    (dict(max_context=2**63), "max_context = 9223372036854775808"),
    (dict(host_bytes=-1), "host_bytes = -1"),
])
def test_configuration_integers_ctypes_would_cut_are_refused(kw, message):
    with pytest.raises(ess.InvalidArgument, match=message):
        small(**kw)


def test_plan_is_ess_plan():
    p = ess.plan(hardware="h200", contexts=[32768], min_otps=15)
    assert p["plans"][0]["context"] == 32768 and "chosen" in p["plans"][0]
    with pytest.raises(ess.InvalidArgument, match="unknown request field 'bogus'"):
        ess.plan(bogus=1)
    with pytest.raises(ess.InvalidArgument, match="hardware"):
        ess.plan(hardware="tpu-v9")
    json.dumps(p)


def test_plan_for_sglang_gives_its_launch_line():
    p = ess.plan(engine="sglang", hardware="h200", contexts=[131072], min_otps=10, no_tbo=True)
    launch = p["plans"][0]["launch"]
    assert p["engine"] == "sglang" and launch["release"] == "0.5.23"
    assert launch["argv"][:3] == ["python", "-m", "ess.integrations.sglang_launch"]
    assert "--enable-hisparse" in launch["argv"] and "--enable-two-batch-overlap" not in launch["argv"]
    assert p["plans"][0]["chosen"]["overlap"] in ("none", "da", "dba", "layerwise")
    stock = p["plans"][0]["stock_hisparse"]   # SGLang's own HiSparse at its defaults, beside the plan
    assert stock["config"]["device_buffer_size"] == 4096 and 1 <= stock["batch"] <= stock["admitted"]
    assert "launch" not in ess.plan(hardware="h200", contexts=[32768])["plans"][0]
    with pytest.raises(ess.InvalidArgument, match="plans for sglang \\(0.5.23\\) and vllm \\(0.33.0\\)"):
        ess.plan(engine="tgi")
    v = ess.plan(engine="vllm", hardware="h200", contexts=[32768], min_otps=15)["plans"][0]
    assert v["launch"]["argv"][:2] == ["vllm", "serve"]
    mode = v["chosen"]["overlap"]
    assert v["launch"]["env"][:1] == ([f"ESS_OVERLAP={mode}"] if mode != "none" else [])
    d = ess.plan(engine="vllm", hardware="h200", contexts=[131072], min_otps=10, modes=["dba"])["plans"][0]
    assert d["chosen"]["overlap"] == "dba" and d["launch"]["env"] == ["ESS_OVERLAP=dba"]
    with pytest.raises(ess.InvalidType, match="engine"):
        ess.plan(engine=3)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    e = small()
    row = e.admit(1, 50)
    rows = torch.tensor([row], dtype=torch.int32)
    lengths = torch.tensor([50], dtype=torch.int32)
    topk = torch.arange(8, dtype=torch.int32).reshape(1, 1, 8)
    phys = torch.empty_like(topk)
    e.bind_step(rows, topk, lengths, phys).step(0)
    assert phys.flatten().tolist() == [row * 16 + i for i in range(8)]
    with pytest.raises(ess.InvalidArgument, match="int32 is needed"):
        e.bind_step(rows, topk.long(), lengths, phys)
