"""A serving engine in miniature for the adapter tests: requests with their full latent cache (the
bytes attention would read with everything on the GPU), the model's KV write of each step's new
entries, and the indexer's top-k (random ids, newest tokens, -1 padding, int32 or int64)."""
from __future__ import annotations

import numpy as np

ENTRY = 656


class World:
    def __init__(self, seed, layers, topk, query_tokens, max_context):
        self.rng = np.random.default_rng(seed)
        self.layers, self.K, self.T, self.max_context = layers, topk, query_tokens, max_context
        self.full = {}     # request -> [layers, max_context, E] uint8
        self.length = {}   # request -> tokens

    def new_request(self, request, prompt_length):
        self.full[request] = self.rng.integers(0, 256, (self.layers, self.max_context, ENTRY), dtype=np.uint8)
        self.length[request] = prompt_length
        return self.full[request][:, :prompt_length]

    def warmup_topk(self, request, windows):
        n = self.length[request]
        out = np.full((self.layers, windows, self.K), -1, np.int32)
        for layer in range(self.layers):
            for w in range(windows):
                k = min(self.K, n)
                out[layer, w, :k] = self.rng.choice(n, k, replace=False)
        return out

    def query_rows(self, request):
        """T rows of K distinct ids of this step: random old ids, sometimes newest ones, a -1 tail."""
        n = self.length[request]
        rows = np.full((self.T, self.K), -1, np.int64)
        for t in range(self.T):
            k = int(self.rng.integers(max(1, self.K // 2), self.K + 1))
            k = min(k, n)
            ids = self.rng.choice(n, k, replace=False)
            if self.rng.random() < 0.5:  # the newest tokens are selected often
                newest = np.arange(n - self.T, n)
                ids = np.unique(np.concatenate([newest, ids]))[:k]
                self.rng.shuffle(ids)
            rows[t, :k] = ids
        return rows


def check_rows(world, model, engine_rows, latent, layer, batch, physical, counts=None):
    """Every real position's rows against the model, and the bytes they hold against the full cache."""
    for b, (request, row) in enumerate(batch):
        if request is None:
            assert (physical[b] == -1).all(), f"padded position {b} has rows {physical[b]}"
            continue
        n = world.length[request]
        expected, hits, misses = model.step(row, layer, n, engine_rows[b].tolist())
        np.testing.assert_array_equal(physical[b], np.array(expected), err_msg=f"layer {layer} position {b}")
        if counts is not None:
            assert tuple(counts[b]) == (hits, misses), f"layer {layer} position {b}: {counts[b]} vs {(hits, misses)}"
        for t in range(world.T):
            for k in range(world.K):
                i = engine_rows[b][t][k]
                if i < 0:
                    continue
                got = latent[layer][physical[b][t][k]]
                if not np.array_equal(got, world.full[request][layer][i]):
                    raise AssertionError(f"layer {layer} position {b} id {i}: row {physical[b][t][k]} holds other "
                                         "bytes than the full cache")
