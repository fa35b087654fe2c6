"""An ESS coordinator with the methods and tensor shapes of SGLang's HiSparseCoordinator
(python/sglang/srt/managers/hisparse_coordinator.py), so the NSA/DSA backend's decode path calls
it where it calls HiSparse:

    # ScheduleBatch.prepare_for_decode, after seq_lens += 1:
    reserved = coordinator.map_last_loc_to_buffer(seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu)
    # the new token's KV goes to `reserved` (rows of ESS's layer buffer), not out_cache_loc
    # forward_decode, per layer, after the indexer:
    page_table_1 = coordinator.swap_in_selected_pages(req_pool_indices, seq_lens, topk_indices, layer_id)
    # sparse attention (FlashMLA) over ESS's layer buffer with `page_table_1` as its indices

Differences from HiSparse, by design: pool rows are SGLang's req_pool_indices (max_requests must
cover the req_to_token pool); -1 ids are padding anywhere (HiSparse's long path reads host slot
-1); T > 1 (MTP) takes topk [bs x T, K]; the slot pool is int32 (no 32K cap); the prompt's entries
and the prefill's last top-k are handed over at admission (admit_request_direct)."""
from __future__ import annotations

from typing import Optional

from .._errors import InvalidArgument
from ..engine import Engine
from ._session import DecodeSession


def _pool_index(req) -> int:
    idx = getattr(req, "req_pool_idx", None)
    if idx is None:
        raise InvalidArgument(f"{type(req).__name__} has no req_pool_idx (is it admitted to SGLang's req_to_token pool?)")
    return int(idx)


def _length(req) -> int:
    for attr in ("seqlen", "kv_committed_len"):
        value = getattr(req, attr, None)
        if value is not None:
            return int(value)
    fill = getattr(req, "fill_ids", None)
    if fill is not None:
        return len(fill)
    raise InvalidArgument(f"{type(req).__name__} has neither seqlen nor fill_ids: pass prompt_length")


class HiSparseCoordinator:
    """ESS in HiSparse's place. `engine` must have reserve_newest=True; `max_batch` is the largest decode batch
    (CUDA-graph padding included); `like` gives the staging tensors' kind and device (a torch CUDA tensor with
    the CUDA backend; numpy by default)."""

    def __init__(self, engine: Engine, max_batch: int, like=None):
        self.session = DecodeSession(engine, max_batch, like)
        self.engine = engine
        # As HiSparse's: the batch's real requests (an int, or a one-element tensor); positions past it are padding.
        self.num_real_reqs: Optional[object] = None

    # ---- admission (scheduler) ----
    def admit_request_direct(self, req, entries=None, warmup_topk=None, prompt_length: Optional[int] = None):
        """The request's prompt is in ESS: `entries` (host [layers, n, E] bytes: the prefill's latent cache, e.g.
        kv_buffer[layer][req_to_token[idx, :n]].cpu()) and `warmup_topk` (int32 [layers, W, K]: the prefill's last
        W query positions' top-k, for LRU-Warmup) are both optional."""
        n = _length(req) if prompt_length is None else int(prompt_length)
        self.session.admit(_pool_index(req), n, entries, warmup_topk)

    def admit_request_into_staging(self, req, entries=None, warmup_topk=None, prompt_length: Optional[int] = None):
        """HiSparse stages the prefill's KV to the host asynchronously; ESS takes it at once (a synchronous copy)."""
        self.admit_request_direct(req, entries, warmup_topk, prompt_length)

    def collect_ready_reqs(self):
        return []  # nothing is ever staging

    def has_ongoing_staging(self) -> bool:
        return False

    def request_finished(self, req):
        self.session.finish(_pool_index(req))

    def retract_req(self, req):
        self.session.finish(_pool_index(req))

    # ---- decode ----
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu,
                               req_pool_indices_cpu=None):
        """Before a decode forward (after seq_lens grew by T): writes the previous step's new entries back to the
        host pool, extends every request, and returns where the model must write this step's new KV: rows of
        ESS's layer buffer, [bs] (T = 1) or [bs, T]. `out_cache_loc` is unused (the reserved rows replace it)."""
        del out_cache_loc
        rows_host = req_pool_indices if req_pool_indices_cpu is None else req_pool_indices_cpu
        self.session.begin_step(rows_host, seq_lens_cpu, rows_device=req_pool_indices, lengths_device=seq_lens,
                                num_real=self.num_real_reqs)
        reserved = self.session.reserved_rows()
        return reserved.reshape(-1) if self.engine.info.query_tokens == 1 else reserved

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id, stream=None):
        """topk [bs, K] (or [bs x T, K] with MTP), logical token positions, -1 = padding, int32 or int64 ->
        the rows of ESS's layer buffer `layer_id` that sparse attention reads (int32, same shape): its
        page_table_1. The rows and lengths are the ones map_last_loc_to_buffer staged for this step."""
        del req_pool_indices, seq_lens
        return self.session.step(layer_id, top_k_result, stream)

    def wait_for_pending_backup(self):
        self.session.flush()

    def get_token_stats(self):
        s = self.engine.stats()
        return {"hits": s.hits, "misses": s.misses, "reserved_hits": s.reserved_hits,
                "host_bytes_used": s.host_bytes_used}
