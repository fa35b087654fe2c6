"""Stand-ins, on CPU torch, for the SGLang 0.5.23 objects a HiSparse coordinator is built on, each
doing what the cited upstream code does with the state the coordinator touches (SGLang's own
classes do not import here: docs/integration.md says why). They are not the system under test:
they hold SGLang's side of the state so that the replay can check what the coordinator does to it.

  ReqToTokenPool                  srt/mem_cache/memory_pool.py            ReqToTokenPool
  PagedAllocator                  srt/mem_cache/allocator/paged.py        PagedTokenToKVPoolAllocator
  HiSparseAllocator               srt/mem_cache/allocator/hisparse.py     HiSparseTokenToKVPoolAllocator
  HiSparseDevicePool              srt/mem_cache/hisparse_memory_pool.py   HiSparseDSATokenToKVPool
"""
from __future__ import annotations

import torch

ENTRY = 656


class ReqToTokenPool:
    """size request slots 1..size; row 0 is the padding row CUDA-graph and DP padding point at."""

    def __init__(self, size: int, max_context_len: int):
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32)
        self.max_context_len = max_context_len
        self.free_slots = list(range(1, size + 1))


class PagedAllocator:
    """Pages 1..num_pages of page_size slots (page 0 is the padding sink); alloc takes the lowest free pages
    (paged.py: alloc, clear, free -> free_pages)."""

    def __init__(self, size: int, page_size: int):
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)

    def available_size(self):
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int):
        pages = -(-need_size // self.page_size)
        if pages > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return (out[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[:need_size]

    def free(self, indices: torch.Tensor):
        if indices.numel() == 0:
            return
        pages = torch.unique(indices.to(torch.int64) // self.page_size)
        assert int(pages.min()) >= 1 and int(pages.max()) <= self.num_pages, \
            f"freeing pages {pages.tolist()} outside this allocator's 1..{self.num_pages}"
        assert not bool(torch.isin(pages, self.free_pages).any()), f"double free of pages {pages.tolist()}"
        self.free_pages = torch.sort(torch.cat([self.free_pages, pages])).values


class HiSparseDevicePool:
    """kv_buffer[layer]: [size + page_size, 1, 656] uint8; set_mla_kv_buffer writes through
    full_to_hisparse_device_index_mapping (hisparse_memory_pool.py: set_mla_kv_buffer ->
    translate_loc_to_hisparse_device)."""

    def __init__(self, size: int, page_size: int, layer_num: int):
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.start_layer = 0
        self.kv_cache_dim = ENTRY
        self.host_capacity_tokens = None
        self.kv_buffer = [torch.zeros((size + page_size, 1, ENTRY), dtype=torch.uint8) for _ in range(layer_num)]
        self.full_to_hisparse_device_index_mapping = None

    def register_mapping(self, mapping):
        self.full_to_hisparse_device_index_mapping = mapping

    def translate_loc_from_full_to_hisparse_device(self, full_indices):
        return self.full_to_hisparse_device_index_mapping[full_indices]

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, entries: torch.Tensor):
        """The model's write of entries [n, 656] at logical locations `loc` (its out_cache_loc)."""
        device = self.full_to_hisparse_device_index_mapping[loc.to(torch.int64)]
        self.kv_buffer[layer_id - self.start_layer][device, 0] = entries


class HiSparseAllocator:
    """Logical ids (size x ratio) and device slots (size); alloc_extend gives a prefill both and maps them,
    alloc_decode gives logical ids only (allocator/hisparse.py)."""

    compress_ratio = 1

    def __init__(self, size: int, page_size: int, kvcache: HiSparseDevicePool, host_to_device_ratio: int):
        self._kvcache = kvcache
        self.page_size = page_size
        self._size_full = size * host_to_device_ratio
        self._size_hisparse = size
        self.logical_attn_allocator = PagedAllocator(self._size_full, page_size)
        self.hisparse_attn_allocator = PagedAllocator(size, page_size)
        self.full_to_hisparse_device_index_mapping = torch.cat(
            [torch.zeros(self._size_full + page_size, dtype=torch.int64), torch.tensor([-1])])
        kvcache.register_mapping(self.full_to_hisparse_device_index_mapping)

    def get_kvcache(self):
        return self._kvcache

    def available_size(self):
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def alloc_extend(self, n: int):
        """A prefill of n tokens of one request (page-aligned here: one request per call)."""
        logical = self.logical_attn_allocator.alloc(n)
        device = self.hisparse_attn_allocator.alloc(n)
        assert logical is not None and device is not None, "the test's pools are too small"
        self.full_to_hisparse_device_index_mapping[logical] = device
        return logical

    def alloc_decode(self, n: int):
        """alloc_for_decode: one logical id per request (one page each here, as a page boundary would); with
        page size 1 it is allocator.alloc, which maps a device slot to each as well."""
        out = self.logical_attn_allocator.alloc(n * self.page_size)
        assert out is not None, "the test's logical pool is too small"
        out = out.view(n, self.page_size)[:, 0].contiguous()
        if self.page_size == 1:
            device = self.hisparse_attn_allocator.alloc(n)
            assert device is not None, "the test's device pool is too small"
            self.full_to_hisparse_device_index_mapping[out] = device
        return out

    def get_last_loc_compressed(self, last_locs):
        return last_locs

    def free_hisparse_indices(self, buffer_indices):
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.page_size])

    def free_hisparse(self, free_indices):
        device = self.full_to_hisparse_device_index_mapping[free_indices.to(torch.int64)]
        self.free_hisparse_indices(device[device > 0])
        self.full_to_hisparse_device_index_mapping[free_indices.to(torch.int64)] = 0

    def free(self, free_index):
        """release_kv_cache: the request's logical ids and whatever device slots they still map to."""
        if free_index.numel() == 0:
            return
        pages = torch.unique(free_index.to(torch.int64) // self.page_size) * self.page_size
        self.logical_attn_allocator.free(pages)
        self.free_hisparse(free_index)
