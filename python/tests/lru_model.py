"""An independent model of the per-layer step's rows (docs/architecture.md, "Exact semantics"),
written from the rules, not from the library: what the adapters' answers are checked against."""
from __future__ import annotations


class NaiveLru:
    """One request-layer's slots: which token each holds and when it was last used."""

    def __init__(self, slots: int):
        self.token = [-1] * slots
        self.recency = [-1] * slots
        self.clock = 0

    def step(self, query_rows):
        """query_rows: T lists of ids (-1 skipped). Returns ({id: slot}, hits, misses)."""
        working = []
        seen = set()
        for row in query_rows:
            for t in row:
                if t >= 0 and t not in seen:
                    seen.add(t)
                    working.append(t)
        slot_of = {tok: s for s, tok in enumerate(self.token) if tok >= 0}
        hits = [t for t in working if t in slot_of]
        misses = [t for t in working if t not in slot_of]
        protected = {slot_of[t] for t in hits}
        victims = sorted((self.recency[s], s) for s in range(len(self.token)) if s not in protected)
        assert len(misses) <= len(victims), "the model's pool cannot hold the working set"
        for t, (_, s) in zip(misses, victims):
            self.token[s] = t
            slot_of[t] = s
        for t in working:
            self.recency[slot_of[t]] = self.clock
        self.clock += 1
        return {t: slot_of[t] for t in working}, len(hits), len(misses)


class EngineModel:
    """Every request-layer of an engine: rows for a step's ids, reserved rows for the newest (reserve_newest).

    Residency ("Residency"): a whole request's ids map to its own rows (`slots` tokens per pool row it takes) and
    its query rows are recorded, the last recorded_windows per layer, as the LRU would see them; a demoted one's LRU
    is those windows replayed, one step each. follow() takes the engine's residency as it changes (the policy
    that changes it is checked by the C++ cases)."""

    def __init__(self, layers, slots, query_tokens, reserve_newest, warmup_windows=32, demotion_windows=8):
        self.layers, self.slots, self.T = layers, slots, query_tokens
        self.reserve_newest = reserve_newest
        self.rows_per_request = slots + (query_tokens if reserve_newest else 0)
        self.warmup_windows = warmup_windows
        self.recorded_windows = min(demotion_windows, warmup_windows)
        self.lru = {}
        self.units = {}       # row -> the pool rows of a whole request, its own first
        self.recorded = {}    # (row, layer) -> its last recorded_windows query rows while whole

    def admit(self, row):
        for layer in range(self.layers):
            self.lru[(row, layer)] = NaiveLru(self.slots)
            self.recorded[(row, layer)] = []
        self.units.pop(row, None)

    def release(self, row):
        for layer in range(self.layers):
            del self.lru[(row, layer)]
            del self.recorded[(row, layer)]
        self.units.pop(row, None)

    def follow(self, row, whole, units):
        """The engine says request `row` is whole on `units` (or sparse): promotions forget the recorded rows,
        demotions replay them into a fresh LRU."""
        if whole and row not in self.units:
            for layer in range(self.layers):
                self.recorded[(row, layer)] = []
        elif not whole and row in self.units:
            for layer in range(self.layers):
                self.lru[(row, layer)] = NaiveLru(self.slots)
                for window in self.recorded[(row, layer)]:
                    self.lru[(row, layer)].step([window])
                self.recorded[(row, layer)] = []
            del self.units[row]
        if whole:
            self.units[row] = list(units)

    def _record(self, row, layer, window):
        rec = self.recorded[(row, layer)]
        rec.append(list(window))
        del rec[:max(0, len(rec) - self.recorded_windows)]

    def warmup(self, row, windows):
        """windows[layer][w] = K ids, oldest first; the last warmup_windows are replayed, one step each (a whole
        request records them instead)."""
        for layer in range(self.layers):
            ws = list(windows[layer])
            for window in ws[max(0, len(ws) - self.warmup_windows):]:
                if row in self.units:
                    self._record(row, layer, window)
                else:
                    self.lru[(row, layer)].step([list(window)])

    def step(self, row, layer, length, query_rows):
        """The physical row of every id (-1 for padding) of one position, and (hits, misses)."""
        newest = length - self.T
        masked = [[t if not (self.reserve_newest and t >= newest) else -1 for t in q] for q in query_rows]
        if row in self.units:
            units = self.units[row]
            for q in masked:
                self._record(row, layer, q)
            out = []
            for q in query_rows:
                out.append([-1 if t < 0 else
                            row * self.rows_per_request + self.slots + (t - newest)
                            if self.reserve_newest and t >= newest else
                            units[t // self.slots] * self.rows_per_request + t % self.slots for t in q])
            return out, 0, 0
        slot_of, hits, misses = self.lru[(row, layer)].step(masked)
        out = []
        for q in query_rows:
            rows = []
            for t in q:
                if t < 0:
                    rows.append(-1)
                elif self.reserve_newest and t >= newest:
                    rows.append(row * self.rows_per_request + self.slots + (t - newest))
                else:
                    rows.append(row * self.rows_per_request + slot_of[t])
            out.append(rows)
        return out, hits, misses
