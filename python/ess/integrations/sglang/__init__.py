"""ESS in the place of SGLang's HiSparseCoordinator (sglang==0.5.23,
sglang/srt/managers/hisparse_coordinator.py): the same constructor, the same methods, attributes,
argument lists and return types at every call site of that release, so SGLang's own
`--enable-hisparse` runs ESS once `install()` has put this class where ModelRunner imports it.

Where the bytes live. Every request's ESS rows (its LRU slots plus T reserved rows for the step's
newest tokens: T = 1, or the draft tokens of a verify step) lie inside SGLang's HiSparse device pool (`HiSparseDSATokenToKVPool.kv_buffer`), in a region
this coordinator takes from the top of the pool's allocator at construction: FlashMLA reads the
rows `swap_in_selected_pages` returns from the same buffer it reads under HiSparse. The model writes
each decode token with its unchanged `set_mla_kv_buffer(out_cache_loc)`: `map_last_loc_to_buffer`
points out_cache_loc's entry of the allocator's full-to-device mapping at the request's reserved
row, as upstream does. The Total Memory Pool (host) is ESS's own.

Order, as upstream's. map_last_loc_to_buffer (ScheduleBatch.prepare_for_decode, on the schedule
stream) backs up the previous step's newest entries on a backup stream that waits for the schedule
and producer (forward) streams; wait_for_pending_backup (ModelRunner, before the forward) makes the
forward wait for that backup and nothing else. Prefill KV is staged to the host on a staging
stream (admit_request_into_staging) and the request joins decode when collect_ready_reqs finds the
copy done on every TP rank. `num_real_reqs` is an int32 [1] device tensor read when the swap runs.

Speculative decoding: prepare_spec_verify extends every request by the T draft tokens and points
their out_cache_loc at the T reserved rows; the verify forward swaps [bs, T, K]; commit_spec_accept_tokens
writes the accepted entries back and takes the others back (Offload::truncate).

PD decode (direct admission): `mem_pool_host` is ESS's Total Memory Pool, laid out as upstream's "layer_first"
host pool (one region per layer, a request's page at the same index in every layer), so SGLang's transfer backend
registers it and writes the prefill's KV straight into ESS's pages; admit_request_direct then only warms the
request's rows up from them.

DeepSeek-V4's C4 pool (pools.py): ESS's rows are pages of SGLang's HiSparseC4DevicePool, every count in C4 entries
(one per 4 tokens); a request gets an entry on the step that completes one. MiniMax-M3's K / V pool: ESS's rows are
slots of its HiSparseMHAMainPool, K and V in their two tensors; swap_in_selected_blocks expands the block top-k to
its tokens.

What differs from upstream is in docs/integration.md; what this build cannot serve (page sizes that do not divide
64; with DeepSeek-V4 or MiniMax-M3, speculative decoding, the overlap schedules and PD decode) is refused by name at
construction. Two-batch overlap is served: each batch a
forward swaps for (the whole batch, each micro-batch) has its rows staged apart (forward_batches.py).

The package: coordinator.py (the class: construction, the decode swap and its backup, speculative
decoding), forward_batches.py (the rows and lengths of each batch a forward swaps for), overlap.py (ESS_OVERLAP=da:
the DA overlap inside the DSA backend's decode; layerwise: each layer's schedule), indexer_split.py (ESS_OVERLAP=dba:
the DSA indexer run per half of the batch, the first half's copy under the second's indexer), shared_index.py
(shared-index layers: a follower's step issued at its leader's swap, its copy under the layers between), staging.py
(admission: the prefill staged to the host, PD direct admission, release), host_pool.py (ESS's Total Memory Pool as
SGLang's PD host pool), install.py (the class and the wrappers put where SGLang imports them), _common.py (what they
share: SGLang's types, argument checks, settings), pools.py (the device pool's kind: DSA, DeepSeek-V4's C4 or MiniMax-M3's K / V)."""
from ._common import (ENTRY_BYTES, SGLANG_VERSION, HiSparseAct, HiSparseTokenStats, SpecScratch, _sglang_setting,
                      _token_stats_type)
from .coordinator import HiSparseCoordinator
from .host_pool import HostPool
from .install import UPSTREAM_MODULE, install

# The public classes under the package's name, as SGLang, logs and pickles see them.
for _cls in (HiSparseCoordinator, HostPool):
    _cls.__module__ = __name__

__all__ = ["ENTRY_BYTES", "SGLANG_VERSION", "UPSTREAM_MODULE", "HiSparseAct", "HiSparseCoordinator", "HiSparseTokenStats",
           "HostPool", "SpecScratch", "install", "_sglang_setting", "_token_stats_type"]
