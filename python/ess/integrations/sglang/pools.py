"""The HiSparse device pool ESS takes its rows from, one class per kind SGLang 0.5.23 builds: DeepSeek-V3.2's (and
GLM-5's) DSA pool of 656-byte latent entries, indexed by token; DeepSeek-V4's C4 pool of compressed entries (one
per 4 tokens) kept in pages of 64 (their values, then their scales); MiniMax-M3's main pool of its sparse layers' K
and V, in two tensors. Each says how its entries lie (the engine's buffers over the rows ESS claimed; the prefill's
entries gathered for staging), how SGLang's token counts become its units, and which of the allocator's mapping
entries a request's tokens own."""
from __future__ import annotations

import torch

from ..._errors import InvalidArgument
from ._common import ENTRY_BYTES

C4_RATIO = 4           # tokens per C4 entry (HiSparseC4DevicePool.compress_ratio)
C4_PAGE = 64           # entries per C4 page (the pool's page_size: the logical 256 // 4)
C4_VALUE_BYTES = 576   # an entry's 448 FP8 NoPE values and 64 BF16 RoPE values (kvcacheio.cuh)
C4_SCALE_BYTES = 8     # its 7 UE8M0 scales and one pad byte, after the page's 64 value runs
C4_ENTRY_BYTES = 584   # KVLayout.V4's bytes per token
C4_PAGE_BYTES = 37440  # KVLayout.V4.page_bytes(64): 64 x 584 padded to a multiple of 576


class DsaPool:
    """HiSparseDSATokenToKVPool (mem_cache/hisparse_memory_pool.py): one [slots, 1, kv_cache_dim] tensor per layer,
    656 FP8 bytes a token (--kv-cache-dtype fp8_e4m3) or the latent's kv_lora_rank + qk_rope_head_dim bf16 values
    (bfloat16, SGLang's DSA default on Hopper: 1,152 bytes); the allocator's mapping indexed by the token's logical
    slot."""
    kind = "DSA"
    ratio = 1
    blocks = False              # the top-k names tokens (MiniMax-M3's names blocks)
    entry_bytes = ENTRY_BYTES   # a host entry

    def __init__(self, allocator):
        kvcache = allocator.get_kvcache()
        if not hasattr(kvcache, "full_to_hisparse_device_index_mapping") or not hasattr(kvcache, "kv_cache_dim"):
            raise InvalidArgument(
                f"{type(kvcache).__name__}: ESS serves the DSA HiSparse MLA pool, DeepSeek-V4's C4 pool and "
                "MiniMax-M3's K / V pool")
        entry = kvcache.kv_cache_dim * kvcache.kv_buffer[0].element_size()
        latent = getattr(kvcache, "kv_lora_rank", 512) + getattr(kvcache, "qk_rope_head_dim", 64)
        self.bf16 = kvcache.kv_buffer[0].dtype == torch.bfloat16 and kvcache.kv_cache_dim == latent
        if entry != ENTRY_BYTES and not self.bf16:
            raise InvalidArgument(
                f"the device pool's entries are {entry} bytes of {kvcache.kv_buffer[0].dtype}; ESS serves DeepSeek-V3.2's "
                f"{ENTRY_BYTES}-byte FP8 latent (--kv-cache-dtype fp8_e4m3) and its bf16 latent ({latent} bf16 values, "
                "--kv-cache-dtype bfloat16)")
        self.entry_bytes = entry
        self.device = kvcache
        self.layer_num = kvcache.layer_num
        self.start_layer = getattr(kvcache, "start_layer", 0) or 0
        self.page_size = kvcache.page_size

    def units(self, tokens: int) -> int:
        """A request of `tokens` tokens holds this many entries in ESS."""
        return tokens

    def entry_steps(self, seq_lens):
        """Of a step's requests at seq_lens tokens (a device tensor), those whose step writes a new entry, as a device
        bool tensor; None: every one (device work only, no host read)."""
        return None

    def units_of(self, seq_lens):
        """units() of a device tensor of token counts, by device work."""
        return seq_lens

    def host_units(self, allocator, host_to_device_ratio: float) -> int:
        """The Total Memory Pool's entries per layer, as upstream sizes its host pool (pool_host/mla.py:
        host_to_device_ratio x the device pool's tokens)."""
        kvcache = self.device
        device_tokens = kvcache.size if getattr(kvcache, "host_capacity_tokens", None) is None \
            else kvcache.host_capacity_tokens
        return int(device_tokens * host_to_device_ratio)

    def engine_buffers(self, first_row: int, rows: int) -> dict:
        """Engine keyword arguments: the rows [first_row, first_row + rows) of every layer as ESS's buffers; for a
        bf16 latent, the entry's model (DeepSeek-V3.2's fields, the pool's latent widths, kv_cache_dtype bfloat16:
        the engine reads the entry and nothing else of it)."""
        out = dict(latent=[self._rows(buf)[first_row:first_row + rows] for buf in self.device.kv_buffer])
        if self.bf16:
            rank, rope = getattr(self.device, "kv_lora_rank", 512), getattr(self.device, "qk_rope_head_dim", 64)
            out["model"] = {
                "num_hidden_layers": self.layer_num, "hidden_size": 7168, "vocab_size": 129280,
                "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": rank, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": rope, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 2048, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                "num_experts_per_tok": 8, "max_position_embeddings": 163840, "kv_cache_dtype": "bfloat16"}
        return out

    def gather(self, layer: int, device_locs):
        """The entries at the pool's slots `device_locs` (int64), as ESS's host entries [n, entry_bytes]."""
        return self._rows(self.device.kv_buffer[layer]).index_select(0, device_locs)

    def mapping_locs(self, full_locs):
        """The allocator mapping's entries the tokens at logical slots `full_locs` own."""
        return full_locs

    def _rows(self, buf):
        return buf.view(torch.uint8).view(-1, self.entry_bytes)


class C4Pool:
    """HiSparseC4DevicePool (mem_cache/deepseek_v4_memory_pool.py), the DeepSeek-V4 allocator's hisparse_kvcache: one
    [pages, 37440] uint8 tensor per C4 layer, page p holding entries 64p .. 64p + 63 as their 576-byte values then
    their 8-byte scales (kvcacheio.cuh); the allocator's mapping indexed by compressed logical slot (full // 4 of a
    token completing an entry). SGLang passes the C4 layer's index (the pool's layer_mapping compress_layer_id) as
    the swap's layer_id, and every count in C4 entries (compressed_seq_lens = seq_len // 4)."""
    kind = "DeepSeek-V4 C4"
    ratio = C4_RATIO
    blocks = False
    entry_bytes = 592           # a host entry: the 584 bytes padded to 16 (ESS's LatentLayout for DeepSeek-V4)

    def __init__(self, allocator):
        kvcache = allocator.hisparse_kvcache
        layout = getattr(kvcache, "kv_layout", None)
        facts = (getattr(kvcache, "page_size", None), getattr(kvcache, "kv_cache_total_dim", None),
                 getattr(kvcache, "bytes_per_page_padded", None), getattr(layout, "name", layout))
        if facts != (C4_PAGE, C4_ENTRY_BYTES, C4_PAGE_BYTES, "V4"):
            raise InvalidArgument(
                f"{type(kvcache).__name__}: page size, bytes per token, page bytes and layout {facts}; ESS serves "
                f"DeepSeek-V4's C4 pool as SGLang 0.5.23 builds it for HiSparse ({C4_PAGE}, {C4_ENTRY_BYTES}, "
                f"{C4_PAGE_BYTES}, V4)")
        for l, buf in enumerate(kvcache.kv_buffer):
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != C4_PAGE_BYTES or not buf.is_contiguous():
                raise InvalidArgument(f"the C4 pool's kv_buffer[{l}] is {buf.dtype} {list(buf.shape)}; contiguous "
                                      f"uint8 [pages, {C4_PAGE_BYTES}] expected")
        self.device = kvcache
        self.layer_num = kvcache.layer_num
        self.start_layer = 0   # the C4 layer index SGLang passes counts this stage's C4 layers from 0
        self.page_size = C4_PAGE
        self.pages = int(kvcache.kv_buffer[0].shape[0]) if kvcache.kv_buffer else 0

    def units(self, tokens: int) -> int:
        """A request's C4 entries: tokens // 4, and at least one. ESS holds no empty request, so one with fewer than
        4 tokens keeps one entry its top-k cannot name yet (compressed_seq_lens 0: every position -1) until its
        fourth token writes it, in the row ESS keeps for the newest."""
        return max(1, tokens // C4_RATIO)

    def entry_steps(self, seq_lens):
        """metadata_kernel.py: the compressor writes an entry when seq_len % 4 == 0."""
        return torch.remainder(seq_lens, C4_RATIO) == 0

    def units_of(self, seq_lens):
        return torch.clamp(torch.div(seq_lens, C4_RATIO, rounding_mode="floor"), min=1)

    def host_units(self, allocator, host_to_device_ratio: float) -> int:
        """Upstream's C4 host pool holds the logical pool's entries whatever the ratio (hisparse_coordinator.py:
        size_full // 4, in pages of 64; the device pool is size_full // (4 x ratio))."""
        return allocator.size_full // C4_RATIO

    def engine_buffers(self, first_row: int, rows: int) -> dict:
        """The engine's buffers in two parts over the claimed pages: each row's values in its page's value run, its
        scales in the page's scale run; the model of the entry (DeepSeek-V4: 592-byte entries in the host pool)."""
        if first_row % C4_PAGE:
            raise InvalidArgument(f"ESS's first C4 row {first_row} is not at a page boundary")
        first, count = first_row // C4_PAGE, -(-rows // C4_PAGE)
        values = C4_PAGE * C4_VALUE_BYTES
        latent = [buf[first:first + count, :values].view(count, C4_PAGE, C4_VALUE_BYTES)
                  for buf in self.device.kv_buffer]
        tail = [buf[first:first + count, values:values + C4_PAGE * C4_SCALE_BYTES].view(count, C4_PAGE,
                                                                                          C4_SCALE_BYTES)
                for buf in self.device.kv_buffer]
        d = self.device
        model = {"model_type": "deepseek_v4", "num_hidden_layers": self.layer_num,
                 "compress_ratios": [C4_RATIO] * self.layer_num,
                 "head_dim": d.qk_nope_head_dim + d.qk_rope_head_dim, "qk_rope_head_dim": d.qk_rope_head_dim}
        return dict(model=model, latent=latent, latent_tail=tail, split_bytes=C4_VALUE_BYTES,
                    tail_bytes=C4_SCALE_BYTES)

    def gather(self, layer: int, device_locs):
        """The entries at the C4 pool's slots `device_locs` (int64), as ESS's host entries [n, entry_bytes]: values,
        scales, zero padding."""
        buf = self.device.kv_buffer[layer]
        values = C4_PAGE * C4_VALUE_BYTES
        page, at = device_locs // C4_PAGE, device_locs % C4_PAGE
        out = torch.zeros((device_locs.numel(), self.entry_bytes), dtype=torch.uint8, device=buf.device)
        out[:, :C4_VALUE_BYTES] = buf[:, :values].view(-1, C4_PAGE, C4_VALUE_BYTES)[page, at]
        out[:, C4_VALUE_BYTES:C4_ENTRY_BYTES] = (
            buf[:, values:values + C4_PAGE * C4_SCALE_BYTES].view(-1, C4_PAGE, C4_SCALE_BYTES)[page, at])
        return out

    def mapping_locs(self, full_locs):
        """full // 4 for every slot, not only those completing an entry (the pool's own translation selects those
        with a mask, which reads the device): a request's logical pages are its own, whole groups of four, so the
        extra indices name its own entries still to complete, whose mapping nothing set."""
        return torch.div(full_locs, C4_RATIO, rounding_mode="floor")


class KvPool(DsaPool):
    """MiniMaxSparseKVPool's main pool with HiSparse (HiSparseMHAMainPool, mem_cache/hisparse_memory_pool.py): its
    sparse layers' K and V, each [slots + page, head_num, head_dim] of the store dtype in a tensor of its own
    (k_buffer[l], v_buffer[l], l = the model layer less start_layer, the first sparse layer), the allocator's mapping
    indexed by the token's logical slot as for DSA. HiSparse serves one KV head per TP rank (upstream's coordinator
    asserts it). The swap is swap_in_selected_blocks: a top-k of blocks, which ESS expands to their tokens."""
    kind = "MiniMax-M3 K / V"
    blocks = True

    def __init__(self, allocator):
        main = allocator.get_kvcache().main_pool
        if getattr(main, "head_num", None) != 1:
            raise InvalidArgument(
                f"the MiniMax-M3 main pool has {getattr(main, 'head_num', None)} KV heads a rank; HiSparse serves one "
                "(raise the tensor-parallel size, as upstream's coordinator asks)")
        layers = list(getattr(main, "model_layer_ids", range(main.start_layer, main.start_layer + main.layer_num)))
        if layers != list(range(main.start_layer, main.start_layer + main.layer_num)):
            raise InvalidArgument(f"the MiniMax-M3 sparse layers {layers} are not consecutive: the pool's layer "
                                  "index is the model layer less start_layer (memory_pool.py), which needs them so")
        self.key_bytes = main.bytes_per_token_k
        if main.bytes_per_token_v != self.key_bytes or self.key_bytes % 16:
            raise InvalidArgument(f"MiniMax-M3 K of {self.key_bytes} bytes and V of {main.bytes_per_token_v} a token: "
                                  "ESS moves equal K and V of a multiple of 16 bytes")
        for name, bufs in (("k_buffer", main.k_buffer), ("v_buffer", main.v_buffer)):
            for l, buf in enumerate(bufs):
                if not buf.is_contiguous() or buf[0].numel() * buf.element_size() != self.key_bytes:
                    raise InvalidArgument(f"the MiniMax-M3 pool's {name}[{l}] is {buf.dtype} {list(buf.shape)}; "
                                          f"contiguous rows of {self.key_bytes} bytes expected")
        self.device = main
        self.layer_num = main.layer_num
        self.start_layer = main.start_layer
        self.page_size = main.page_size
        self.entry_bytes = 2 * self.key_bytes

    def engine_buffers(self, first_row: int, rows: int) -> dict:
        """The engine's buffers in two parts: each row's key in the K tensor, its value in the V tensor, at the row's
        place in each; the entry's model: K then V of one head (the engine reads nothing else of it)."""
        d = self.device
        width = d.store_dtype.itemsize
        if width not in (1, 2, 4):
            raise InvalidArgument(f"the MiniMax-M3 pool stores {d.store_dtype} ({width} bytes a value); ESS moves K / V "
                                  "values of 1, 2 or 4 bytes")
        # The engine moves bytes: a 2-byte store (bf16 or fp16) is named bfloat16 to it alike.
        kv_dtype = {1: "fp8_e4m3", 2: "bfloat16", 4: "float32"}[width]
        head_dim = self.key_bytes // width
        model = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3",
                 "num_hidden_layers": self.layer_num, "hidden_size": head_dim, "vocab_size": 1,
                 "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": head_dim,
                 "torch_dtype": "bfloat16", "kv_cache_dtype": kv_dtype,
                 "sparse_attention_config": {"sparse_attention_freq": [1] * self.layer_num, "sparse_block_size": 1,
                                             "sparse_topk_blocks": 1, "sparse_index_dim": 128,
                                             "sparse_num_index_heads": 1, "sparse_init_block": 0,
                                             "sparse_local_block": 0}}
        kb = self.key_bytes
        return dict(model=model,
                    latent=[self._kv_rows(buf)[first_row:first_row + rows] for buf in d.k_buffer],
                    latent_tail=[self._kv_rows(buf)[first_row:first_row + rows] for buf in d.v_buffer],
                    split_bytes=kb, tail_bytes=kb)

    def gather(self, layer: int, device_locs):
        """The tokens' K and V at the pool's slots, as ESS's host entries [n, 2 x key bytes]: key, then value."""
        d = self.device
        return torch.cat([self._kv_rows(d.k_buffer[layer]).index_select(0, device_locs),
                          self._kv_rows(d.v_buffer[layer]).index_select(0, device_locs)], dim=1)

    def _kv_rows(self, buf):
        return buf.view(torch.uint8).view(-1, self.key_bytes)

    def _rows(self, buf):
        raise AssertionError("a K / V pool has no latent rows")


def device_pool(allocator):
    """The pool of SGLang's HiSparse allocator, as ESS reads it."""
    if getattr(allocator, "compress_ratio", 1) == C4_RATIO and hasattr(allocator, "hisparse_kvcache"):
        return C4Pool(allocator)
    if getattr(allocator, "compress_ratio", 1) == 1 and hasattr(allocator, "hisparse_attn_allocator") and \
            hasattr(allocator.get_kvcache(), "main_pool"):
        return KvPool(allocator)
    if getattr(allocator, "compress_ratio", 1) != 1 or not hasattr(allocator, "hisparse_attn_allocator"):
        raise InvalidArgument(
            f"{type(allocator).__name__} (compress_ratio {getattr(allocator, 'compress_ratio', 1)}): ESS serves "
            "SGLang's HiSparse allocators for DSA models and MiniMax-M3 (HiSparseTokenToKVPoolAllocator) and "
            "DeepSeek-V4 (DeepSeekV4HiSparseTokenToKVPoolAllocator)")
    return DsaPool(allocator)
