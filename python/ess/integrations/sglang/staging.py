"""A request's way into and out of ESS under SGLang: the prefill's KV staged to the host pages on the staging stream
(admit_request_into_staging, collected by collect_ready_reqs on every TP rank), PD direct admission (the transfer
writes ESS's host pages through HostPool.alloc_paged_token_slots, admit_request_direct warms the rows up), abort,
retract and release (a row is released once its last device work is done)."""
from __future__ import annotations


import torch

from ..._errors import InvalidArgument
from ._common import HiSparseAct, _int, _keep


class Staging:
    """HiSparseCoordinator's admission and release (the coordinator's state: coordinator.py)."""

    def _alloc_direct(self, req_to_host_pool, allocated_len, req_pool_idx, start_pos, num_tokens):
        """HostPool.alloc_paged_token_slots: the request enters ESS (host pages, all-or-nothing) and its token slots
        in the host pool's layer regions go to req_to_host_pool; the transfer then writes the prompt there."""
        idx, start, n = (_int("req_pool_idx", req_pool_idx), _int("start_pos", start_pos),
                         _int("num_tokens", num_tokens))
        if not 0 <= idx < self.max_batch:
            raise InvalidArgument(f"alloc_paged_token_slots: req_pool_idx = {idx} outside the request slots "
                                  f"[0, {self.max_batch})")
        if req_to_host_pool is not self._req_to_host_pool or allocated_len is not self.req_to_host_pool_allocated_len:
            raise InvalidArgument("alloc_paged_token_slots: pass the coordinator's own req_to_host_pool and "
                                  "req_to_host_pool_allocated_len")
        if self._holds(idx):
            # A request in ESS: its host pages follow its length (ESS's own write-back fills them), so the slots
            # already allocated are returned, as upstream returns them; growing past them is ESS's own.
            have = int(allocated_len[idx])
            if start < 0 or n < 0 or start + n > have:
                raise InvalidArgument(
                    f"alloc_paged_token_slots: request slot {idx}, tokens [{start}, {start + n}): ESS holds its host "
                    f"slots up to {have}; it adds pages as the request grows at each step, not through this call")
            return req_to_host_pool[idx, start:start + n]
        if start != 0 or int(allocated_len[idx]) != 0:
            raise InvalidArgument(
                f"alloc_paged_token_slots: request slot {idx}, start_pos {start}, {int(allocated_len[idx])} tokens "
                "allocated: ESS's host pool receives a whole prompt into a request slot that holds nothing")
        if not 0 < n <= self.req_to_token_pool.max_context_len:
            raise InvalidArgument(f"alloc_paged_token_slots: num_tokens = {n} outside [1, "
                                  f"{self.req_to_token_pool.max_context_len}]")
        self._host_admit(idx, n)
        self._direct[idx] = n
        return req_to_host_pool[idx, :n]

    def _holds(self, idx: int) -> bool:
        """Whether the request slot is ESS's: decoding, or received by a PD transfer and not yet admitted."""
        return idx in self._length or idx in self._direct

    def _host_admit(self, idx: int, n: int) -> None:
        """The request enters ESS with n tokens (host pages, zeroed; all-or-nothing) and, as upstream's
        alloc_paged_token_slots, its token slots in the host pool's layer regions go to req_to_host_pool,
        page-rounded, with req_to_host_pool_allocated_len the rounded length."""
        self._ess().admit(idx, n, row=idx)
        self._publish_host_slots(idx, n)

    def _publish_host_slots(self, idx: int, n: int) -> None:
        """req_to_host_pool[idx] and its allocated length cover the request's first n tokens, page-rounded: the
        slots of ESS's host pages (token t of page g at g x 64 + t % 64), added as the request grows (upstream's
        alloc_paged_token_slots adds them as its backup reaches them: SGLang reads the same table)."""
        have = int(self.req_to_host_pool_allocated_len[idx])
        end = min(-(-n // self.page_size) * self.page_size, self.req_to_host_pool.shape[1])
        if end <= have:
            return
        pages = torch.tensor(self.engine.host_pages(idx), dtype=torch.int64)
        slots = (pages.view(-1, 1) * 64 + torch.arange(64, dtype=torch.int64).view(1, -1)).view(-1)[have:end]
        self.req_to_host_pool[idx, have:end] = slots.to(self.req_to_host_pool.device, non_blocking=True)
        self.req_to_host_pool_allocated_len[idx] = end

    def admit_request_into_staging(self, req) -> None:
        """After the prefill: the request's prompt KV (SGLang's device slots of req_to_token[idx, :extend_end])
        is copied into its ESS host pages on the staging stream (one device-to-host copy per run of consecutive
        pages and layer); collect_ready_reqs hands the request to decode."""
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = self.pool.units(_int("extend_end", req.extend_end))
        if self._holds(idx):
            raise InvalidArgument(f"admit_request_into_staging: request slot {idx} is already in ESS")
        self._host_admit(idx, n)   # host pages (all-or-nothing) and req_to_host_pool, as upstream
        req.hisparse_staging = True
        full = self.req_to_token_pool.req_to_token[idx, :_int("extend_end", req.extend_end)].to(dtype=torch.int64,
                                                                                               copy=True)
        device_locs = self.mem_pool_device.translate_loc_from_full_to_hisparse_device(full)
        runs = self.mem_pool_host.runs(idx, n)
        start, finish = self.dev.Event(), self.dev.Event()
        start.record()
        with self.dev.stream(self.write_staging_stream):
            start.wait(self.write_staging_stream)
            self.dev.launch(lambda: self._stage_copy(runs, device_locs))
            _keep(device_locs, self.write_staging_stream)
            finish.record()
        self.ack_staging_queue.append(HiSparseAct(start, finish, req))

    def _stage_copy(self, runs, device_locs):
        """The prompt's entries of every layer, gathered from SGLang's pool and copied once, straight into the
        request's ESS host pages (`runs`: HostPool.runs). A C4 request of under 4 tokens has no entry to copy (its
        one entry in ESS stays zero until its fourth token writes it)."""
        have = int(device_locs.shape[0])
        for layer in range(self.layer_num):
            rows = self.pool.gather(layer, device_locs)
            host = self.mem_pool_host.layer_view(layer)
            for at, start, count in runs:
                count = min(count, have - start)
                if count > 0:
                    host[at:at + count].copy_(rows[start:start + count], non_blocking=True)

    def _finish_staging(self, req):
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = _int("extend_end", req.extend_end)
        # The prefill's device slots go back to SGLang's allocator (and its mapping to 0).
        self.token_to_kv_pool_allocator.free_hisparse(self.req_to_token_pool.req_to_token[idx, :n])
        self._join_decode(req, idx, self.pool.units(n), entries=n // self.pool.ratio)

    def _join_decode(self, req, idx: int, n: int, entries=None):
        """The request's first residency (warmed up from its host pages) and newest entries: it decodes from here.
        `entries`: those the prompt wrote, when fewer than the n ESS holds (a C4 request of under 4 tokens holds
        one its fourth token writes: warmed up, a row would keep its zeros as if they were the entry)."""
        # ESS's warm-up also puts the prompt's newest entries into the reserved rows (token n - T + t in reserved
        # row t), so a swap at the prompt's own length, before SGLang extends the request, serves them.
        self._ess().warmup(idx, self._warmup_windows(n if entries is None else entries))
        self._direct.pop(idx, None)
        self._length[idx] = n
        req.hisparse_staging = False
        if self._recorder is not None:
            self._recorder.begin(idx, req.rid, n)

    def _warmup_windows(self, n: int):
        """The first residency: the prompt's last min(n, slots) tokens, oldest first (SGLang hands over no
        prefill top-k to warm up from); none (one window of padding) for n = 0."""
        K = self.step_k
        keep = min(n, self.info.slots)
        windows = max(1, -(-keep // K))
        ids = torch.full((windows * K,), -1, dtype=torch.int32)
        ids[windows * K - keep:] = torch.arange(n - keep, n, dtype=torch.int32)
        return ids.view(1, windows, K).expand(self.layer_num, windows, K).contiguous()

    def admit_request_direct(self, req) -> None:
        """The transfer is done (the prompt's KV is in ESS's host pages): the request's first residency is warmed up
        from them and it joins decode. Nothing of SGLang's device pool is taken."""
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = self.host_token_len(req.kv.kv_allocated_len)
        if self._direct.get(idx) != n:
            raise InvalidArgument(
                f"admit_request_direct: request slot {idx} with {n} tokens was not received through "
                f"mem_pool_host.alloc_paged_token_slots" + (f" (it received {self._direct[idx]})" if idx in self._direct
                                                            else ""))
        self._join_decode(req, idx, n)

    def has_ongoing_staging(self) -> bool:
        return len(self.ack_staging_queue) > 0

    def collect_ready_reqs(self):
        ready = []
        if not self.ack_staging_queue:
            return ready
        finished = 0
        for act in self.ack_staging_queue:
            if not act.finish_event.query():
                break
            finished += 1
        count = torch.tensor(finished, dtype=torch.int, device="cpu")
        if self.tp_world_size > 1:   # every TP rank hands the same requests to decode
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        for _ in range(int(count.item())):
            act = self.ack_staging_queue.pop(0)
            act.finish_event.synchronize()
            self._finish_staging(act.req)
            ready.append(act.req)
        return ready

    def abort_staging_request(self, req) -> None:
        self.ack_staging_queue = [act for act in self.ack_staging_queue if act.req is not req]
        self.write_staging_stream.synchronize()
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        self.token_to_kv_pool_allocator.free_hisparse(self.req_to_token_pool.req_to_token[idx, :_int("extend_end", req.extend_end)])
        self._ess().release(idx)
        self._forget_host_slots(idx)
        req.hisparse_staging = False

    def retract_req(self, req) -> None:
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def request_finished(self, req) -> None:
        if self.decode_producer_stream is not None:
            self.dev.current_stream().wait_stream(self.decode_producer_stream)
        self.wait_for_pending_backup()
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        if idx in self._direct:   # PD: received (or receiving failed) but never admitted; no device work of ours
            del self._direct[idx]
            self._forget_host_slots(idx)
            self._ess().release(idx)
            return
        if idx not in self._length:
            if getattr(req, "hisparse_staging", False):
                self.abort_staging_request(req)
            return   # never admitted to ESS (finished during prefill): nothing of ours to release
        # Decode tokens' logical slots map to the reserved row: unmap them so that SGLang's own free of
        # the request's KV does not hand ESS's rows to its allocator.
        allocated = self.pool.mapping_locs(
            self.req_to_token_pool.req_to_token[idx, :_int("kv_allocated_len", req.kv.kv_allocated_len)].to(torch.int64))
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        self.dev.launch(lambda: mapping.index_fill_(0, allocated, 0))
        del self._length[idx]
        if self._recorder is not None:
            self._recorder.end(idx)
        self._verifying.discard(idx)
        self._forget_host_slots(idx)
        if self._backup_due is not None:
            self._dropped_rows.append(idx)
        # After the waits above: ESS resets its rows in the current stream's order and holds its host pages until
        # that stream has passed the release (nothing waits on the host).
        self._ess().release(idx)

    def _forget_host_slots(self, idx: int):
        if self._req_to_host_pool is not None and int(self.req_to_host_pool_allocated_len[idx]) > 0:
            self._req_to_host_pool[idx].fill_(-1)
        self.req_to_host_pool_allocated_len[idx] = 0

    def _ess(self):
        """The engine, its lifecycle calls ordered on the current stream: on CUDA their device work is enqueued there
        and not waited for (Engine.set_lifecycle_stream), as upstream's admission and release enqueue theirs."""
        if self.dev.is_cuda:
            self.engine.set_lifecycle_stream(self.dev.current_stream())
        return self.engine
