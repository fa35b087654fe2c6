"""Bad input to ESS's vLLM runtime: every refusal is an InvalidArgument naming what was wrong, raised before
anything runs, so a refused swap_in serves no layer (the next call of the forward still runs) and changes no
row, count or byte; start_step refuses a batch it cannot serve with ESS's state as it was."""
import types

import pytest
import torch

import ess
from ess.integrations import vllm as adapter
from test_vllm_replay import K, UP, Replay, decode_step, prefill

UP_VIEW = UP["PagedCacheView"]

T = 2


@pytest.fixture
def staged():
    """Two requests decoding, a step staged (start_step and begin_forward ran) and a valid swap_in call."""
    r = Replay(T, 40, seed=21)
    prefill(r, "a", 3, 90, 100)
    prefill(r, "b", 1, 70, 100, others=["a"], other_states=[3])
    batch, states = ["b", "a"], [1, 3]
    scheduled = {rid: adapter.Scheduled(*v) for rid, v in decode_step(batch, r.world, T).items()}
    r.decode.start_step(batch, torch.tensor(states, dtype=torch.int32), scheduled)
    for h in r.handles:
        h.runtime.begin_forward()
    n = 2 * T
    args = dict(resident=r.handles[0], req_id_per_token=torch.tensor([0, 0, 1, 1], dtype=torch.int32),
                block_table=r.handles[0].source_block_table,
                logical_topk_indices=torch.arange(n * K, dtype=torch.int32).reshape(n, K) % 60,
                block_size=64, num_valid_rows=torch.tensor([n], dtype=torch.int32), return_valid_counts=True)
    return r, r.handles[0].runtime, args


def snapshot(r, runtime):
    return (runtime.layers_served, runtime.steps_served, r.engine.stats(), r.decode.latent[0].clone(),
            r.decode.physical.clone())


def unchanged(before, after):
    assert before[:3] == after[:3]
    assert torch.equal(before[3], after[3]) and torch.equal(before[4], after[4])


@pytest.mark.parametrize("change,match", [
    (dict(attention_indices_out=torch.empty((3, K), dtype=torch.int32)), "attention_indices_out"),
    (dict(attention_indices_out=torch.empty((4, K), dtype=torch.int64)), "attention_indices_out"),
    (dict(valid_counts_out=torch.empty((5,), dtype=torch.int32)), "valid_counts_out"),
    (dict(logical_topk_indices=torch.zeros((4, K + 1), dtype=torch.int32)), "logical_topk_indices"),
    (dict(block_size=32), "block_size"),
    (dict(logical_topk_indices=torch.zeros((4 * 100, K), dtype=torch.int32)), "max_swap_rows"),
])
def test_a_refused_swap_in_serves_nothing(staged, change, match):
    r, runtime, args = staged
    before = snapshot(r, runtime)
    with pytest.raises(ess.InvalidArgument, match=match):
        runtime.swap_in(**{**args, **change})
    unchanged(before, snapshot(r, runtime))
    physical, valid = runtime.swap_in(**args)   # the layer is still to be served this forward
    assert runtime.layers_served == 1 and physical.shape == (4, K) and valid.dtype == torch.int32


def test_caller_owned_outputs_are_filled_and_returned(staged):
    r, runtime, args = staged
    out, counts = torch.empty((4, K), dtype=torch.int32), torch.empty((4,), dtype=torch.int32)
    physical, valid = runtime.swap_in(**args, attention_indices_out=out, valid_counts_out=counts)
    assert physical is out and valid is counts
    assert torch.equal(counts, (out >= 0).sum(1).to(torch.int32))


def test_a_second_swap_in_in_one_forward_is_refused(staged):
    r, runtime, args = staged
    runtime.swap_in(**args)
    before = snapshot(r, runtime)
    with pytest.raises(ess.InvalidArgument, match="twice in one forward"):
        runtime.swap_in(**args)
    unchanged(before, snapshot(r, runtime))


def test_rows_past_num_valid_rows_are_padding(staged):
    r, runtime, args = staged
    physical, valid = runtime.swap_in(**{**args, "num_valid_rows": torch.tensor([T], dtype=torch.int32)})
    assert (physical[T:] == -1).all() and (valid[T:] == 0).all() and (physical[:T] >= 0).any()


@pytest.mark.parametrize("batch,states,scheduled,match", [
    (["b", "a"], [1, 9], None, "state index 9"),
    (["b", "a"], [1, 1], None, "state index 1 is batch rows"),
    (["b", "x"], [1, 3], None, "not scheduled"),
    (["b", "a"], [1, 3], {"b": (71, T), "a": (383, T)}, "max_context"),
    (["b", "a"], [1, 3], {"b": (71, T), "a": (-5, T)}, "request 'a''s computed tokens = -5"),
    (["a", "b"], [3, 1], {"b": (71, T), "a": (91, -1)}, "request 'a''s scheduled tokens = -1"),
])
def test_start_step_refuses_a_batch_and_changes_nothing(batch, states, scheduled, match):
    r = Replay(T, 40, seed=22)
    prefill(r, "a", 3, 90, 100)
    prefill(r, "b", 1, 70, 100, others=["a"], other_states=[3])
    before = (dict(r.decode.state_of), dict(r.decode.length_of), r.engine.stats(), r.decode.rows.clone())
    scheduled = scheduled or decode_step(["a", "b"], r.world, T)
    with pytest.raises(ess.InvalidArgument, match=match):
        r.decode.start_step(batch, torch.tensor(states, dtype=torch.int32),
                            {rid: adapter.Scheduled(*v) for rid, v in scheduled.items()})
    after = (dict(r.decode.state_of), dict(r.decode.length_of), r.engine.stats(), r.decode.rows.clone())
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])


@pytest.mark.parametrize("name", ["finished", "preempted", "fresh"])
def test_start_step_refuses_a_missing_id_set_by_name(name):
    r = Replay(T, 40, seed=23)
    prefill(r, "a", 3, 90, 100)
    before = (dict(r.decode.state_of), r.engine.stats())
    with pytest.raises(ess.InvalidType, match=f"start_step: {name} = None: an iterable of request ids"):
        r.decode.start_step(["a"], torch.tensor([3], dtype=torch.int32), {"a": adapter.Scheduled(90, T)},
                            **{name: None})
    assert (dict(r.decode.state_of), r.engine.stats()) == before


def test_a_host_block_outside_vllms_pool_is_refused_by_the_engine():
    """A block table entry past vLLM's host pool (a table ESS was not built over): the engine refuses the request
    by name; the requests before it in the batch were served."""
    r = Replay(T, 40, seed=24)
    prefill(r, "a", 3, 90, 100)
    r.world.gather(["a"])
    r.world.source_block_table[0, 1] = 10**6
    with pytest.raises(ess.InvalidArgument, match="page 1 is 1000000, outside"):
        r.decode.start_step(["a"], torch.tensor([3], dtype=torch.int32), {"a": adapter.Scheduled(90, T)})
    assert r.decode.state_of == {}


def metadata(num_decodes, num_decode_tokens, seq_lens):
    """What start_step reads of the forward's sparse MLA metadata (sparse_mla_attention.py build)."""
    return types.SimpleNamespace(num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


@pytest.mark.parametrize("forward,n,match", [
    (metadata(2, T - 1, [90 + T, 0]), T, "the forward has 2 decode rows of 1 tokens"),       # padded, too few
    (metadata(1, T - 1, [90 + T]), T, "the forward has 1 decode rows of 1 tokens"),          # fewer than the row's
    (metadata(1, T, []), T, "seq_lens has 0 rows"),
    # seq_lens are read (and checked) where the host needs the true count: a row of fewer than T tokens
    (metadata(1, 1, [90 + 1 + 1]), 1, "seq_len 92 is outside \\[1, the scheduler's 90 computed \\+ 1 scheduled"),
    (metadata(1, 1, [0]), 1, "seq_len 0 is outside \\[1, the scheduler's 90 computed"),
])
def test_a_forward_that_does_not_fit_the_batch_is_refused(forward, n, match):
    """The forward's decode split and seq_lens (its attention metadata) must fit the scheduled batch: padded rows
    only add rows and tokens after every batch row, and a decode row's computed tokens are at most the
    scheduler's count (an upper bound under async scheduling)."""
    r = Replay(T, 40, seed=23)
    prefill(r, "a", 3, 90, 100)
    scheduled = {"a": adapter.Scheduled(90, n)}
    before = (dict(r.decode.length_of), r.engine.stats())
    with pytest.raises(ess.InvalidArgument, match=match):
        r.decode.start_step(["a"], torch.tensor([3], dtype=torch.int32), scheduled, attn_metadata=forward)
    assert before == (dict(r.decode.length_of), r.engine.stats())


def test_counts_that_run_ahead_stay_on_the_host_and_the_step_takes_the_forwards():
    """Async scheduling with drafts: the scheduler still counts a draft the last verify step rejected. ESS's host
    keeps that count (the request holds the blocks of its drafts) and its step serves the forward's seq_len, copied
    on the device, with nothing read back."""
    r = Replay(T, 40, seed=23)
    prefill(r, "a", 3, 90, 100)
    scheduled = {"a": adapter.Scheduled(90, T)}
    blocks = {"a": (list(r.world.blocks["a"]), True)}   # the host blocks from the scheduler's output
    r.decode.start_step(["a"], torch.tensor([3], dtype=torch.int32), scheduled,
                        attn_metadata=metadata(4, 4 * T, [90 + T, 0, 0, 0]), new_blocks=blocks)   # a FULL graph
    assert r.decode.length_of == {3: 90 + T}
    reads = r.decode.device_reads
    scheduled = {"a": adapter.Scheduled(90 + T + 1, T)}   # the scheduler still counts a rejected draft
    r.decode.start_step(["a"], torch.tensor([3], dtype=torch.int32), scheduled,
                        attn_metadata=metadata(1, T, [90 + 2 * T]), new_blocks={})
    assert r.decode.length_of == {3: 90 + 2 * T + 1} and r.engine.request(3) == (3, 90 + 2 * T + 1)
    assert int(r.decode.lengths[0]) == 90 + 2 * T and r.decode.device_reads == reads


class WholeViewGuard(torch.Tensor):
    """vLLM's resident view, failing any operation that makes a new tensor as large as the view (a copy of it)."""
    limit = None   # the view's elements

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.numel() >= cls.limit and func.__name__ != "__get__":
            raise AssertionError(f"swap_in ran {func.__name__} over vLLM's whole resident view")
        return out


def test_swap_in_reads_only_the_newest_rows_of_the_resident_view(staged):
    """The resident view is strided (runtime.py PagedCacheView.bind: the block stride spans the slab's other
    groups): swap_in gathers the step's newest rows from it, and never copies the view whole."""
    r, runtime, args = staged
    view = r.handles[0].view
    WholeViewGuard.limit = view.cache.numel()
    guarded = types.SimpleNamespace(view=UP_VIEW(view.cache.as_subclass(WholeViewGuard), view.attention_cache,
                                                 view.block_size, view.attention_block_stride),
                                    slot_mapping=r.handles[0].slot_mapping)
    runtime.swap_in(**{**args, "resident": guarded})
    with pytest.raises(AssertionError, match="whole resident view"):
        guarded.view.cache.reshape(-1, 656)   # what a copy of the view looks like to the guard


def test_vllms_statistics_count_the_leader_layers_hits_and_misses(staged):
    """worker.py get_kv_connector_stats reads the group leader's index_group.swap_stats ([hits, misses], uint64 on
    the device; int64 here, torch 1.13 has no uint64): ESS adds its step's counts there, on the leader only."""
    r, runtime, args = staged
    stats = torch.zeros(2, dtype=torch.int64)
    runtime.upstream = types.SimpleNamespace(is_group_leader=True, index_group=types.SimpleNamespace(swap_stats=stats))
    follower = r.handles[1].runtime
    follower_stats = torch.zeros(2, dtype=torch.int64)
    follower.upstream = types.SimpleNamespace(is_group_leader=False,
                                              index_group=types.SimpleNamespace(swap_stats=follower_stats))
    runtime.swap_in(**args)
    counts = r.decode.counts.sum(0).tolist()
    assert stats.tolist() == counts and counts[0] + counts[1] > 0
    follower.swap_in(**{**args, "resident": r.handles[1]})
    assert follower_stats.tolist() == [0, 0], "a follower's counts are its leader's"


def test_a_speculator_layer_keeps_vllms_runtime(staged):
    r, _, _ = staged
    r.handles[1].draft_layer = True
    with pytest.raises(ess.InvalidArgument, match="speculator"):
        adapter.HiSparseRuntime(r.decode, 1, r.handles[1])
