"""The decode bookkeeping both adapters share: a fixed set of int32 staging tensors bound once to
the engine (so every per-layer call passes integers, and a CUDA graph sees fixed addresses), the
per-step extend of every request, and the write-back of the previous step's newest entries."""
from __future__ import annotations

import numpy as np

from .._errors import InvalidArgument
from ..engine import Engine
from . import _arrays


class DecodeSession:
    """Steps of up to `max_batch` positions over an engine with reserve_newest (the model writes each step's
    new entries into the reserved rows, as HiSparse's reserved slot).

    `like`: an array or tensor whose kind and device the staging tensors take (numpy for the CPU backend,
    a CUDA tensor for the CUDA backend)."""

    def __init__(self, engine: Engine, max_batch: int, like=None):
        info = engine.info
        if not info.reserve_newest:
            raise InvalidArgument("the adapters need an engine with reserve_newest=True (the model writes each "
                                  "step's new entries into ESS's reserved rows)")
        if not 1 <= max_batch <= info.max_requests:
            raise InvalidArgument(f"max_batch = {max_batch} outside [1, max_requests = {info.max_requests}]")
        like = np.empty(0, np.int32) if like is None else like
        self.engine = engine
        self.info = info
        self.max_batch = max_batch
        T, K = info.query_tokens, info.topk
        self.rows = _arrays.empty_int32((max_batch,), like)
        self.lengths = _arrays.empty_int32((max_batch,), like)
        self.topk = _arrays.empty_int32((max_batch, T, K), like)
        self.physical = _arrays.empty_int32((max_batch, T, K), like)
        self.counts = _arrays.empty_int32((max_batch, 2), like)
        self.arange = _arrays.arange_int32(max_batch, like)
        self.rows[:] = -1
        self.lengths[:] = 0
        self.step_binding = engine.bind_step(self.rows, self.topk, self.lengths, self.physical, counts=self.counts)
        self.write_back_binding = engine.bind_write_back(self.rows, self.lengths)
        self.batch = 0            # positions of the current step
        self.pending = False      # the current step's newest entries are not yet written back
        self.length_of_row = {}   # host view: pool row -> tokens
        self._last_inputs = None  # (rows, lengths) objects last staged, to skip re-staging per layer

    # ---- requests ----
    def admit(self, row: int, prompt_length: int, entries=None, warmup_topk=None):
        """Admits a request at pool row `row` with its prompt's entries (host [layers, n, E] bytes, optional)
        and LRU-Warmup ids (int32 host [layers, W, K], optional). Nothing stays admitted when a part is refused."""
        self.engine.admit(row, prompt_length, row)
        try:
            if entries is not None:
                for layer in range(self.info.layers):
                    self.engine.write_entries(row, layer, 0, entries[layer])
            if warmup_topk is not None:
                self.engine.warmup(row, warmup_topk)
        except Exception:
            self.engine.release(row)
            raise
        self.length_of_row[row] = prompt_length

    def finish(self, row: int):
        """Releases the request at `row`; its position in a pending write-back is dropped."""
        if row not in self.length_of_row:
            raise InvalidArgument(f"request at pool row {row} is not admitted")
        self.engine.release(row)
        del self.length_of_row[row]
        if self.pending:
            _arrays.replace_value(self.rows, row, -1)

    # ---- steps ----
    def flush(self):
        """Writes the last step's newest entries back to the host pool (every layer)."""
        if self.pending:
            for layer in range(self.info.layers):
                self.write_back_binding.write_back(layer, self.batch)
            self.pending = False

    def begin_step(self, rows, lengths_host, rows_device=None, lengths_device=None, num_real=None):
        """A new decode step: the previous step's newest entries go back to the host pool, every real position's
        request is extended to its new length, and the step's rows and lengths are staged.

        rows: pool row per position (host ints; -1 or positions >= num_real are padding); lengths_host: each
        position's tokens after this step (host ints)."""
        rows_h = _arrays.host_ints(rows).reshape(-1)
        lengths_h = _arrays.host_ints(lengths_host).reshape(-1)
        B = rows_h.shape[0]
        if B > self.max_batch or lengths_h.shape[0] != B:
            raise InvalidArgument(f"step of {B} positions with {lengths_h.shape[0]} lengths; at most "
                                  f"{self.max_batch} positions")
        real = B if num_real is None else int(_arrays.host_ints(num_real).reshape(-1)[0]) \
            if not isinstance(num_real, int) else num_real
        T = self.info.query_tokens
        # Check every position before anything changes.
        grow = []
        seen = set()
        for b in range(min(real, B)):
            row = int(rows_h[b])
            if row < 0:
                continue
            if row not in self.length_of_row:
                raise InvalidArgument(f"position {b}: pool row {row} holds no admitted request")
            if row in seen:
                raise InvalidArgument(f"position {b}: pool row {row} appears twice in the batch")
            seen.add(row)
            n = int(lengths_h[b]) - self.length_of_row[row]
            if n != T:
                raise InvalidArgument(f"position {b} (pool row {row}): length {int(lengths_h[b])} is not the "
                                      f"request's {self.length_of_row[row]} + T = {T} new tokens")
            grow.append(row)
        self.flush()
        for row in grow:
            self.engine.extend(row, T)
            self.length_of_row[row] += T
        _arrays.copy_into(self.rows[:B], rows if rows_device is None else rows_device)
        _arrays.copy_into(self.lengths[:B], lengths_host if lengths_device is None else lengths_device)
        _arrays.mask_from(self.rows[:B], self.arange, real)
        self.batch = B
        self.pending = True
        self._last_inputs = None

    def reserved_rows(self):
        """[B, T]: where the model writes this step's T new entries of each position (-1 for padding)."""
        T = self.info.query_tokens
        rows = self.rows[: self.batch]
        base = rows * self.info.rows_per_request + self.info.slots
        t = self.arange[:T]
        out = base.reshape(-1, 1) + t.reshape(1, -1)
        if _arrays.is_torch(out):
            out.masked_fill_(rows.reshape(-1, 1) < 0, -1)
        else:
            out[rows < 0, :] = -1
        return out

    def step(self, layer: int, topk, stream=None):
        """One layer's swap-in: topk [B, K] (T = 1), [B x T, K] or [B, T, K], int32 or int64, -1 = padding.
        Returns the physical rows, shaped like topk, a view of a buffer the next call overwrites."""
        B, T, K = self.batch, self.info.query_tokens, self.info.topk
        n = 1
        for s in topk.shape:
            n *= int(s)
        if n != B * T * K or topk.shape[-1] != K:
            raise InvalidArgument(f"layer {layer}: topk has shape {tuple(topk.shape)}; this step has {B} positions "
                                  f"x T {T} x K {K}")
        staged = self.topk[:B]
        if not _arrays.same_memory(staged, topk):
            _arrays.copy_into(staged, topk)
        self.step_binding.step(layer, B, stream)
        return self.physical[:B].reshape(tuple(topk.shape))
