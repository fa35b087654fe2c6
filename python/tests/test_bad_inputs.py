"""The Python API's bad inputs, as a careless or hostile caller gives them: the table in bad_inputs.tsv
(each call refused with the named ess exception and a message naming the parameter, the engine's digest
unchanged), then threads on one engine (bit-exact against one thread, or refused cleanly once closed)."""
import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

import ess

ENTRY = 656
R1, SHARED, RELEASED = 1, 3, 5
CONFIG = dict(layers=2, max_requests=3, max_context=128, topk=8, slots=16, reserve_newest=True)


def engine(**kw):
    return ess.Engine(**dict(CONFIG, **kw))


def digest(e) -> str:
    """The engine's observable state: statistics, host layout, each request's row, length, pages and host
    entries, and every row of every layer's buffer."""
    h = hashlib.sha256()
    h.update(json.dumps([e.stats().__dict__, e.host_layout().__dict__]).encode())
    for rid in (R1, SHARED):
        row, length = e.request(rid)
        h.update(json.dumps([rid, row, length, e.host_pages(rid)]).encode())
        for layer in range(e.info.layers):
            h.update(e.read_entries(rid, layer, 0, np.zeros((length, ENTRY), np.uint8)).tobytes())
    for layer in range(e.info.layers):
        for row in range(e.info.max_requests * e.info.rows_per_request):
            h.update(e.read_row(layer, row))
    return h.hexdigest()


class Fixture:
    """An engine with a written, warmed-up and stepped request R1, a request SHARED on R1's first page, a
    released request and bound step and write-back tensors; the table's expressions see these names."""

    def __init__(self):
        rng = np.random.default_rng(7)
        self.e = e = engine()
        e.admit(R1, 100, row=0)
        for layer in range(2):
            e.write_entries(R1, layer, 0, rng.integers(0, 256, (100, ENTRY), dtype=np.uint8))
        e.admit_shared(SHARED, 100, R1, 64, row=1)
        e.admit(RELEASED, 10, row=2)
        e.release(RELEASED)
        windows = np.full((2, 2, 8), -1, np.int32)
        windows[:, :, :4] = [[0, 1, 2, 3], [4, 5, 6, 7]]
        e.warmup(R1, windows)
        self.rows, self.lens = np.array([0], np.int32), np.array([100], np.int32)
        self.ids = np.array([[1, 9, 20, 99, -1, -1, -1, -1]], np.int32)
        self.phys = np.zeros((1, 8), np.int32)
        self.sb = e.bind_step(self.rows, self.ids, self.lens, self.phys)
        self.sb.step(0)
        self.sb.step(1)
        self.wb = e.bind_write_back(self.rows, self.lens)

    def names(self):
        e = self.e

        def entry(n):
            return np.zeros((n, ENTRY), np.uint8)

        def window_with(layer, *tokens):
            """Warm-up windows with `tokens` in `layer`'s, and a good id in every layer before it."""
            w = np.full((2, 1, 8), -1, np.int32)
            w[:layer, 0, 0] = 50
            w[layer, 0, :len(tokens)] = tokens
            return w

        def step_with(t, tokens, length=100):
            ids = np.full((1, 8), -1, np.int32)
            ids[0, :len(tokens)] = tokens
            lens = np.array([length], np.int32)
            self._keep = (ids, lens)
            return e.bind_step(self.rows, ids, lens, np.zeros((1, 8), np.int32)).step(t)

        def region():
            """A page-aligned, writable 1 MiB host region (another engine's pool)."""
            import mmap
            return mmap.mmap(-1, 1 << 20)

        def closed_engine():
            x = engine()
            x.close()
            return x

        def closed_binding():
            b = e.bind_step(self.rows, self.ids, self.lens, np.zeros((1, 8), np.int32))
            b.close()
            return b

        def binding_of_closed_engine():
            x = engine()
            b = x.bind_step(np.array([-1], np.int32), self.ids, self.lens, np.zeros((1, 8), np.int32))
            x.close()
            return b

        return dict(np=np, ess=ess, e=e, sb=self.sb, wb=self.wb, rows=self.rows, lens=self.lens, ids=self.ids,
                    ids2=np.zeros((1, 16), np.int32), phys=self.phys, R1=R1, SHARED=SHARED, RELEASED=RELEASED,
                    engine=engine, entry=entry, window_with=window_with, step_with=step_with,
                    closed_engine=closed_engine, closed_binding=closed_binding,
                    binding_of_closed_engine=binding_of_closed_engine, region=region)


def cases():
    out = []
    for n, line in enumerate((Path(__file__).parent / "bad_inputs.tsv").read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            exc, word, call = line.split("\t")
            out.append(pytest.param(exc, word, call, id=f"{n}:{call[:60]}"))
    return out


@pytest.fixture(scope="module")
def fixture():
    return Fixture()


@pytest.mark.parametrize("exc,word,call", cases())
def test_bad_input_is_refused_by_name_and_changes_nothing(fixture, exc, word, call):
    before = digest(fixture.e)
    expected = getattr(ess, exc)
    with pytest.raises(ess.EssError) as info:
        eval(call, fixture.names())
    assert type(info.value) is expected, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, TypeError if expected is ess.InvalidType else ValueError) or \
        not issubclass(expected, ess.InvalidArgument)
    assert word in str(info.value), str(info.value)
    assert digest(fixture.e) == before, "a refused call changed the engine"


def test_the_fixture_is_not_trivial():
    """The digest sees warm-up, steps and host entries (a refusal that changed them would show)."""
    s = Fixture().e.stats()
    assert s.steps == 2 and s.warmup_fills > 0 and s.requests == 2 and s.host_bytes_shared > 0


# ---- threads ----
# Steps long enough (K = 512 ids, most of them misses) that two threads' calls overlap in the library.
THREADED = dict(layers=2, max_requests=2, max_context=4096, topk=512, slots=1024)


def _decode(e, rid, row, seed, steps, out):
    """`steps` decode steps of request `rid` over both layers with random top-k; the physical rows go to `out`."""
    rng = np.random.default_rng(seed)
    K, n = THREADED["topk"], THREADED["max_context"]
    rows, lens = np.array([row], np.int32), np.array([n], np.int32)
    ids, phys = np.full((1, K), -1, np.int32), np.zeros((1, K), np.int32)
    chosen = [rng.choice(n, K, replace=False).astype(np.int32) for _ in range(2 * steps)]
    b = e.bind_step(rows, ids, lens, phys)
    for i in range(2 * steps):
        ids[0] = chosen[i]
        b.step(i % 2)
        out.append(phys.copy())


def _two_requests():
    e = ess.Engine(**THREADED)
    for rid, row in ((10, 0), (11, 1)):
        e.admit(rid, THREADED["max_context"], row=row)
        for layer in range(2):
            e.write_entries(rid, layer, 0, np.full((THREADED["max_context"], ENTRY), rid, np.uint8))
    return e


def test_two_threads_on_one_engine_are_bit_exact():
    """Two threads stepping their own requests on one engine give the rows, statistics and buffers of one thread
    running both in turn."""
    serial, out_serial = _two_requests(), {10: [], 11: []}
    for rid, row in ((10, 0), (11, 1)):
        _decode(serial, rid, row, rid, 200, out_serial[rid])
    shared, out_threads = _two_requests(), {10: [], 11: []}
    threads = [threading.Thread(target=_decode, args=(shared, rid, row, rid, 200, out_threads[rid]))
               for rid, row in ((10, 0), (11, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid in (10, 11):
        assert len(out_threads[rid]) == 400
        assert all(np.array_equal(a, b) for a, b in zip(out_serial[rid], out_threads[rid]))
    assert serial.stats() == shared.stats()
    for layer in range(2):
        for row in range(2 * shared.info.rows_per_request):
            assert serial.read_row(layer, row) == shared.read_row(layer, row)


@pytest.mark.parametrize("round", range(10))
def test_close_while_other_threads_call_is_refused_cleanly(round):
    """Threads calling an engine that another thread closes get InvalidArgument ('closed'), never a crash."""
    e = _two_requests()
    errors, started = [], threading.Barrier(3)

    def worker(rid, row):
        started.wait()
        try:
            while True:
                _decode(e, rid, row, rid + round, 1, [])
                e.stats()
        except ess.InvalidArgument as err:
            errors.append(str(err))

    threads = [threading.Thread(target=worker, args=a) for a in ((10, 0), (11, 1))]
    for t in threads:
        t.start()
    started.wait()
    e.close()
    for t in threads:
        t.join(timeout=60)
    assert len(errors) == 2 and all("closed" in m for m in errors), errors
