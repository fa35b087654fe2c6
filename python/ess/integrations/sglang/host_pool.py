"""ESS's Total Memory Pool as SGLang's PD decode side sees its host pool."""
from __future__ import annotations

import ctypes

import torch

from ._common import _int


class HostPool:
    """ESS's Total Memory Pool where SGLang's PD decode side uses upstream's host pool (MLATokenToKVPoolHost, layout
    "layer_first", with pool_host/hisparse.py's alloc_paged_token_slots). get_contiguous_buf_infos gives the transfer
    backend one region per layer; SGLang page p (page_size tokens) of every layer lies at base[l] + p x item_len,
    i.e. host token slot s at base[l] + s x 656, and a request's slots are g x 64 + t % 64 for its ESS page g of
    token t: the transfer writes the prompt into ESS's own pages, with no copy after it."""
    layout = "layer_first"

    def __init__(self, coordinator):
        self._coordinator = coordinator
        engine = coordinator.engine
        h = engine.host_layout()
        self.layer_num = h.layers
        self.page_size = coordinator.page_size
        self.token_stride_size = h.entry_bytes
        self.size = h.pages_per_layer * h.page_tokens   # token slots of each layer
        self._per_token = h.layers * h.entry_bytes
        self._ptrs = [engine.host_layer(layer) for layer in range(h.layers)]
        self._layer_bytes = h.layer_bytes
        self._views = None

    def layer_view(self, layer: int):
        """Layer `layer`'s region as a uint8 [pages_per_layer x 64, 656] CPU tensor over ESS's memory (pinned when
        the engine is built for CUDA: device-to-host copies into it run asynchronously)."""
        if self._views is None:
            self._views = [torch.frombuffer((ctypes.c_uint8 * self._layer_bytes).from_address(ptr), dtype=torch.uint8)
                           .view(-1, self.token_stride_size) for ptr in self._ptrs]
        return self._views[layer]

    def runs(self, req_pool_idx: int, n: int):
        """The request's first n tokens in its pages as (host slot, first token, count) runs of consecutive slots."""
        pages = self._coordinator.engine.host_pages(_int("req_pool_idx", req_pool_idx))
        out = []
        for i, g in enumerate(pages):
            first, count = i * 64, min(64, n - i * 64)
            if count <= 0:
                break
            if out and out[-1][0] + out[-1][2] == g * 64:
                at, start, c = out[-1]
                out[-1] = (at, start, c + count)
            else:
                out.append((g * 64, first, count))
        return out

    def close(self):
        """Drops the tensor views: they point into the engine's memory, which closes next."""
        self._views = None

    def available_size(self) -> int:
        s = self._coordinator.engine.stats()
        return (s.host_bytes_capacity - s.host_bytes_used) // self._per_token

    def get_contiguous_buf_infos(self):
        """(data_ptrs, data_lens, item_lens) per layer, as upstream's, for the transfer engine to register."""
        n = self.layer_num
        return list(self._ptrs), [self._layer_bytes] * n, [self.token_stride_size * self.page_size] * n

    def alloc_paged_token_slots(self, req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx: int,
                                start_pos: int, num_tokens: int):
        return self._coordinator._alloc_direct(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx,
                                               start_pos, num_tokens)

    def allocated_host_indices(self, req_to_host_pool, req_pool_idx: int, allocated_len: int):
        length = min(-(-_int("allocated_len", allocated_len) // self.page_size) * self.page_size, req_to_host_pool.shape[1])
        indices = req_to_host_pool[req_pool_idx, :length]
        return indices[indices >= 0]
