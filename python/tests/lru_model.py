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
    """Every request-layer of an engine: rows for a step's ids, reserved rows for the newest (reserve_newest)."""

    def __init__(self, layers, slots, query_tokens, reserve_newest, warmup_windows=32):
        self.layers, self.slots, self.T = layers, slots, query_tokens
        self.reserve_newest = reserve_newest
        self.rows_per_request = slots + (query_tokens if reserve_newest else 0)
        self.warmup_windows = warmup_windows
        self.lru = {}

    def admit(self, row):
        for layer in range(self.layers):
            self.lru[(row, layer)] = NaiveLru(self.slots)

    def release(self, row):
        for layer in range(self.layers):
            del self.lru[(row, layer)]

    def warmup(self, row, windows):
        """windows[layer][w] = K ids, oldest first; the last warmup_windows are replayed, one step each."""
        for layer in range(self.layers):
            ws = list(windows[layer])
            for window in ws[max(0, len(ws) - self.warmup_windows):]:
                self.lru[(row, layer)].step([list(window)])

    def step(self, row, layer, length, query_rows):
        """The physical row of every id (-1 for padding) of one position, and (hits, misses)."""
        newest = length - self.T
        masked = [[t if not (self.reserve_newest and t >= newest) else -1 for t in q] for q in query_rows]
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
