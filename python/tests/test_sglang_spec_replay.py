"""SGLang 0.5.23's speculative decode loop (EAGLE / MTP, speculative_eagle_topk 1) replayed through the
coordinator, in upstream's order (test_sglang_replay.py has the rest of the loop and the checks):

  ScheduleBatch.prepare_for_decode returns early in speculative mode (alloc_logical_only; no
  map_last_loc_to_buffer); the draft passes never call the coordinator (model_runner: HiSparse owns
  the target's KV only);
  eagle_utils.eagle_prepare_for_verify -> prepare_spec_verify(batch): batch.seq_lens = L (committed),
  batch.out_cache_loc [bs x T] logical slots of positions L .. L + T - 1;
  the verify forward: per layer set_mla_kv_buffer(out_cache_loc) of the T tokens, then
  dsa_backend.forward_extend (target verify): swap_in_selected_pages(req_pool_indices,
  dsa_seqlens_expanded [bs x T] = L + t + 1, topk [bs, T, K], layer_id);
  eagle_worker_common.run_eagle_verify -> commit_spec_accept_tokens(batch, accept_indices [bs, T]):
  accept_indices[b, s] = the verify slot b x T + j whose KV position L + s keeps, -1 = rejected.

The accepted path's slots are not always j = s (a tree's path is not), and the rejected positions get
new bytes before the next verify (their tokens change): a stale entry anywhere shows."""
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import sglang as adapter
from test_sglang_replay import (K, LAYERS, StagesOncePerForward, TboWorld, World, expect_recorded, micro_batches,
                                recorded_and_handed, replay)


class SpecWorld(World):
    T = 3
    SLOTS = 3 * K     # the pool holds a verify step's union (T x K)

    def prepare_decode(self):
        """prepare_spec_verify's batch: the logical slots of positions L .. L + T - 1. As upstream, a request
        keeps its slots past L (rejected positions' slots serve the same positions next time) and reserves up
        to L + 2T; under the overlap scheduler seq_lens_cpu is None at verify time."""
        rids = list(self.running)
        self.rng.shuffle(rids)
        bs, T = len(rids), self.T
        locs = []
        for rid in rids:
            req, L = self.reqs[rid], self.length[rid]
            idx, have = req.kv.req_pool_idx, req.kv.kv_allocated_len
            if have < L + 2 * T:
                new = self.allocator.alloc_decode(L + 2 * T - have)
                self.req_to_token_pool.req_to_token[idx, have:L + 2 * T] = new.to(torch.int32)
                req.kv.kv_allocated_len = L + 2 * T
            locs.append(self.req_to_token_pool.req_to_token[idx, L:L + T].to(torch.int64))
        out_cache_loc = torch.cat(locs)
        idx = torch.tensor([self.reqs[r].kv.req_pool_idx for r in rids], dtype=torch.int64)
        seq_lens = torch.tensor([self.length[r] for r in rids], dtype=torch.int64)
        batch = types.SimpleNamespace(rids=rids, reqs=[self.reqs[r] for r in rids], req_pool_indices=idx,
                                      out_cache_loc=out_cache_loc, seq_lens=seq_lens,
                                      seq_lens_cpu=seq_lens.clone() if self.rng.random() < 0.5 else None,
                                      forward_mode=types.SimpleNamespace(is_idle=lambda: False),
                                      idx=idx, grow=T)
        self.coord.prepare_spec_verify(batch)
        return batch

    def forward(self, batch):
        coord, bs, T = self.coord, len(batch.rids), self.T
        pad = int(self.rng.integers(0, 3)) if self.graph_pad else 0
        coord.num_real_reqs.fill_(bs if self.rng.random() < 0.5 else bs + pad)   # as in World.forward
        idx = torch.cat([batch.idx, torch.zeros(pad, dtype=torch.int64)])
        expanded = torch.cat([(batch.seq_lens.view(-1, 1) + torch.arange(1, T + 1)).view(-1),
                              torch.ones(pad * T, dtype=torch.int64)]).to(torch.int32)
        for layer in range(LAYERS):
            new = torch.from_numpy(np.stack([self.full[r][layer, self.length[r] + t]
                                             for r in batch.rids for t in range(T)]))
            self.device_pool.set_mla_kv_buffer(layer, batch.out_cache_loc, new)
            rows = [[self.query_token(r, t) for t in range(T)] for r in batch.rids] + \
                [[[0] + [-1] * (K - 1)] * T] * pad
            topk = torch.tensor(rows, dtype=torch.int32)
            table = coord.swap_in_selected_pages(idx, expanded, topk, layer)
            assert table.dtype == torch.int32 and tuple(table.shape) == (bs + pad, T, K)
            self.check(layer, batch, rows, table)
        self.commit(batch)

    def query_token(self, rid, t):
        """Query token t of the verify step sees positions < L + t + 1."""
        n = self.length[rid] + t + 1
        k = min(K, n)
        ids = self.rng.choice(n, k, replace=False)
        if self.rng.random() < 0.5:
            ids = np.unique(np.concatenate([[n - 1], ids]))[:k]
        return ids.tolist() + [-1] * (K - k)

    def commit(self, batch):
        T = self.T
        accept = np.full((len(batch.rids), T), -1, np.int64)
        for b, rid in enumerate(batch.rids):
            kept = int(self.rng.integers(1, T + 1))
            path = [0] + sorted(self.rng.choice(np.arange(1, T), kept - 1, replace=False).tolist())
            accept[b, :kept] = [b * T + j for j in path]
            L = self.length[rid]
            verified = self.full[rid][:, L:L + T].copy()      # the KV the verify forward wrote, slot j
            for s, j in enumerate(path):
                self.full[rid][:, L + s] = verified[:, j]
            self.full[rid][:, L + kept:] = self.rng.integers(0, 256, self.full[rid][:, L + kept:].shape,
                                                             dtype=np.uint8)   # rejected: other tokens next time
            self.length[rid] = L + kept
        self.coord.commit_spec_accept_tokens(batch, torch.tensor(accept, dtype=torch.int32))


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_replay_in_upstream_order(seed):
    replay(seed=seed, world=SpecWorld)


class SpecTboWorld(SpecWorld):
    """Verify steps under two-batch overlap (TboWorld's split): each micro-batch's swap gets its requests'
    [n, T, K] top-k and per-token seq_lens (dsa_backend.py forward_decode's target-verify call), its layer
    writes its requests' T verify tokens, and the commit is once per step over the whole batch."""

    DENSE = TboWorld.DENSE

    def forward(self, batch):
        coord, bs, T = self.coord, len(batch.rids), self.T
        coord.num_real_reqs.fill_(bs)
        expanded = (batch.seq_lens.view(-1, 1) + torch.arange(1, T + 1)).view(-1).to(torch.int32)
        whole, halves = micro_batches(self.rng, batch.idx, expanded, T)
        for layer in range(LAYERS):
            for part_idx, part_lens, positions in ([whole] if layer < self.DENSE else halves):
                real = [p for p in positions if p is not None and p < bs]
                part = types.SimpleNamespace(rids=[batch.rids[p] for p in real], grow=batch.grow)
                if real:
                    new = torch.from_numpy(np.stack([self.full[r][layer, self.length[r] + t]
                                                     for r in part.rids for t in range(T)]))
                    locs = torch.cat([batch.out_cache_loc[p * T:(p + 1) * T] for p in real])
                    self.device_pool.set_mla_kv_buffer(layer, locs, new)
                rows = [[self.query_token(r, t) for t in range(T)] for r in part.rids] + \
                    [[[0] + [-1] * (K - 1)] * T] * (len(positions) - len(real))
                table = coord.swap_in_selected_pages(part_idx, part_lens, torch.tensor(rows, dtype=torch.int32),
                                                     layer)
                assert tuple(table.shape) == (len(positions), T, K)
                self.check(layer, part, rows, table)
        self.commit(batch)


def test_speculative_replay_with_two_batch_overlap():
    replay(seed=4, world=SpecTboWorld)
    with pytest.raises((AssertionError, ess.EssError)):   # micro-batches reading the whole batch's rows
        replay(StagesOncePerForward, seed=4, world=SpecTboWorld)


def test_the_recorded_trace_holds_every_verify_token(tmp_path, monkeypatch):
    """The recorder under verify steps (T = 3 query tokens a step), with and without two-batch overlap."""
    for world in (SpecWorld, SpecTboWorld):
        coord, metadata, recorded = recorded_and_handed(tmp_path, monkeypatch, world)
        assert metadata["ess.mtp"] == "3"
        expect_recorded(coord, recorded)


class CommitsInOrder(adapter.HiSparseCoordinator):
    """Keeps the first `kept` verify slots whatever accept_indices names (a chain, not the accepted path)."""

    def commit_spec_accept_tokens(self, batch, accept_indices):
        B, T = accept_indices.shape
        valid = accept_indices >= 0
        in_order = torch.arange(B).view(-1, 1) * T + torch.arange(T).view(1, -1)
        super().commit_spec_accept_tokens(batch, torch.where(valid, in_order.to(accept_indices.dtype), accept_indices))


class KeepsEveryDraft(adapter.HiSparseCoordinator):
    """Truncates nothing: rejected drafts stay in the request."""

    def commit_spec_accept_tokens(self, batch, accept_indices):
        super().commit_spec_accept_tokens(batch, accept_indices)
        for req in batch.reqs:
            row = req.kv.req_pool_idx
            gap = self.engine.request(row)[1]
            self.engine.extend(row, self.T)  # the engine's length then no longer matches SGLang's
            self._length[row] = gap + self.T


@pytest.mark.parametrize("cls", [CommitsInOrder, KeepsEveryDraft])
def test_the_speculative_replay_catches(cls):
    with pytest.raises((AssertionError, ess.InvalidArgument)):
        replay(cls, seed=0, world=SpecWorld)


def test_verify_refusals_change_nothing():
    w, idx, before = SpecWorld.one_running(7)
    bad = types.SimpleNamespace(reqs=[w.reqs[w.running[0]]], req_pool_indices=torch.tensor([idx]),
                                out_cache_loc=torch.zeros(2, dtype=torch.int64), seq_lens_cpu=None)
    with pytest.raises(ess.InvalidArgument, match="2 verify slots for 1 requests x 3 draft tokens"):
        w.coord.prepare_spec_verify(bad)
    bad.out_cache_loc = torch.zeros(3, dtype=torch.int64)
    bad.seq_lens_cpu = torch.tensor([41])
    with pytest.raises(ess.InvalidArgument, match="seq_len 41 is not its 40 tokens"):
        w.coord.prepare_spec_verify(bad)
    assert w.coord.engine.request(idx) == before
    with pytest.raises(ess.InvalidArgument, match="map_last_loc_to_buffer: with speculative decoding"):
        w.coord.map_last_loc_to_buffer(torch.tensor([41]), torch.tensor([8]), torch.tensor([idx]),
                                       torch.tensor([41]), torch.tensor([idx]))
    batch = w.prepare_decode()
    after_prepare = w.coord.engine.request(idx)
    with pytest.raises(ess.InvalidArgument, match="not each request's own verify slots"):
        w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0, -1, 2]], dtype=torch.int32))
    with pytest.raises(ess.InvalidArgument, match="accept_indices has shape"):
        w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ess.InvalidType, match="accept_indices: torch.float32"):
        w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0.0, 1.9, -1.0]]))   # never truncated
    with pytest.raises(ess.InvalidArgument, match="values below -1"):
        w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0, -2, -2]], dtype=torch.int32))
    with pytest.raises(ess.InvalidArgument, match="have a verify step not committed"):
        w.coord.prepare_spec_verify(batch)
    assert w.coord.engine.request(idx) == after_prepare
    host_before = w.coord.engine.read_entries(idx, 0, 0, np.zeros((after_prepare[1], 656), np.uint8)).copy()
    w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0, 1, -1]], dtype=torch.int32))
    committed = w.coord.engine.request(idx)
    # A second commit of the same verify step (or one with none prepared) would shorten the request again and
    # write a host entry from the reserved rows' stale bytes: refused, nothing changes.
    with pytest.raises(ess.InvalidArgument, match="no verify step prepared"):
        w.coord.commit_spec_accept_tokens(batch, torch.tensor([[0, -1, -1]], dtype=torch.int32))
    assert w.coord.engine.request(idx) == committed
    assert committed[1] == after_prepare[1] - 1
    kept = committed[1]
    host_after = w.coord.engine.read_entries(idx, 0, 0, np.zeros((kept, 656), np.uint8))
    assert np.array_equal(host_after[:kept - 2], host_before[:kept - 2])
