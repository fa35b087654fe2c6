"""python/ess_trace.py refuses what the C++ reader refuses, by name, and loses nothing: a
refused request leaves the writer as it was, a refused write leaves the target file as it was."""
import math

import numpy as np
import pytest

import ess_trace

L, T, K = 2, 2, 4


def writer():
    return ess_trace.TraceWriter(model="m", layers=L, mtp=T, topk=K, provenance="test", synthetic=True)


def good(steps=3, length=10):
    ids = np.full((steps, L, T, K), -1, dtype=np.int64)
    ids[..., 0] = np.arange(steps)[:, None, None]
    ids[..., 1] = 5
    lengths = np.arange(length, length + steps)
    return ids, lengths


def test_a_valid_request_round_trips(tmp_path):
    w = writer()
    ids, lengths = good()
    w.add_request(topk=ids, lengths=lengths, prefill_topk=np.full((L, 2, K), -1), context=10, id="r0")
    path = tmp_path / "t.safetensors"
    w.write(str(path))
    md, reqs = ess_trace.read_trace(str(path))
    assert md["ess.requests"] == "1" and md["requests.0.context"] == "10"
    np.testing.assert_array_equal(reqs[0]["topk"], ids)
    np.testing.assert_array_equal(reqs[0]["lengths"], lengths)
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


@pytest.mark.parametrize("change, words", [
    (lambda ids, lengths: (ids.astype(np.float64), lengths), "not an integer type"),
    (lambda ids, lengths: (np.where(ids == 5, math.nan, ids), lengths), "not an integer type"),
    (lambda ids, lengths: (ids.astype(bool), lengths), "not an integer type"),
    (lambda ids, lengths: (np.where(ids == 5, 2**32 + 5, ids), lengths), "outside [-1, 2147483647]"),
    (lambda ids, lengths: (np.where(ids == 5, -2, ids), lengths), "value -2"),
    (lambda ids, lengths: (ids, lengths.astype(np.float32)), "lengths: dtype float32"),
    (lambda ids, lengths: (ids, lengths - 10), "outside [1, 2147483647]"),
    (lambda ids, lengths: (ids, lengths + 2**31), "outside [1, 2147483647]"),
    (lambda ids, lengths: (np.where(ids == 5, 10, ids), lengths), "id 10 is outside [0, 10)"),
    (lambda ids, lengths: (np.where(ids == -1, 5, ids), lengths), "selected twice"),
    (lambda ids, lengths: (ids[:0], lengths[:0]), "no step"),
    (lambda ids, lengths: (ids[:, :1], lengths), "shape"),
    (lambda ids, lengths: (ids, lengths[:2]), "lengths shape"),
    (lambda ids, lengths: (ids.tolist()[:-1] + [ids.tolist()[-1][:1]], lengths), "topk: a ragged nested sequence"),
    (lambda ids, lengths: (ids, [[1, 2], [3]]), "lengths: a ragged nested sequence"),
])
def test_bad_requests_are_refused_by_name_and_change_nothing(change, words):
    w = writer()
    ids, lengths = good()
    w.add_request(topk=ids, lengths=lengths)
    ids, lengths = change(ids, lengths)
    with pytest.raises(ValueError) as e:
        w.add_request(topk=ids, lengths=lengths)
    assert words in str(e.value), str(e.value)
    assert "request 1" in str(e.value)
    assert len(w.requests) == 1


@pytest.mark.parametrize("kwargs, words", [
    (dict(prefill_topk=np.full((L, 0, K), -1)), "windows in [1, 65536]"),
    (dict(prefill_topk=np.full((L, 2, K), 10)), "id 10 is outside [0, 10)"),
    (dict(prefill_topk=np.full((L, 2, K), 1.5)), "not an integer type"),
    (dict(context=-5), "context -5"),
    (dict(context=0), "context 0"),
    (dict(context=2**31), "context 2147483648"),
    (dict(context=12.0), "context 12.0"),
    (dict(context=11), "context 11 exceeds the length 10 of its first step"),
])
def test_bad_prefill_and_context_are_refused(kwargs, words):
    w = writer()
    ids, lengths = good()
    with pytest.raises(ValueError) as e:
        w.add_request(topk=ids, lengths=lengths, **kwargs)
    assert words in str(e.value), str(e.value)
    assert not w.requests


@pytest.mark.parametrize("bad", [dict(layers=0), dict(mtp=-1), dict(topk=2.0), dict(topk=True)])
def test_bad_shapes_are_refused(bad):
    args = dict(model="m", layers=L, mtp=T, topk=K, provenance="p", synthetic=True)
    args.update(bad)
    with pytest.raises(ValueError):
        ess_trace.TraceWriter(**args)


def test_a_refused_write_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "t.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="at least one request"):
        writer().write(str(target))
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_prefix_groups_are_written_and_checked(tmp_path):
    w = writer()
    ids, lengths = good()
    w.add_request(topk=ids, lengths=lengths, context=10, prefix_group="sys", prefix_tokens=8)
    for kwargs, words in [(dict(prefix_group="sys", prefix_tokens=11), "prefix_tokens 11"),
                          (dict(prefix_tokens=3), "without a prefix_group"),
                          (dict(prefix_group="", prefix_tokens=3), "non-empty string")]:
        with pytest.raises(ValueError, match=words):
            w.add_request(topk=ids, lengths=lengths, context=10, **kwargs)
    assert len(w.requests) == 1
    path = tmp_path / "g.safetensors"
    w.write(str(path))
    md, _ = ess_trace.read_trace(str(path))
    assert md["requests.0.prefix_group"] == "sys" and md["requests.0.prefix_tokens"] == "8"


def test_lengths_beyond_the_models_maximum_are_refused():
    w = ess_trace.TraceWriter(model="deepseek-v3.2-exp", layers=L, mtp=T, topk=K, provenance="test", synthetic=True)
    ids, lengths = good()
    with pytest.raises(ValueError) as e:
        w.add_request(topk=ids, lengths=lengths + 163840 - 11)
    assert "step 2: length 163841 exceeds the max_position_embeddings (163840)" in str(e.value), str(e.value)
    w.add_request(topk=ids, lengths=lengths + 163840 - 12)
    assert len(w.requests) == 1


def test_a_trace_of_units_counts_ids_of_its_units(tmp_path):
    """unit_tokens 4 (DeepSeek-V4's C4 entries): a step of 10 tokens selects among ceil(10 / 4) = 3 ids; the
    trace says so and is version 2 (a version-1 reader refuses it rather than misreads it: the C++ reader takes 1 and 2,
    TraceFormatBadInput.IdsOfUnitsLieBelowTheUnitsTheLengthMakes refuses ess.unit_tokens in version 1)."""
    w = ess_trace.TraceWriter(model="m", layers=L, mtp=T, topk=K, provenance="test", synthetic=False, unit_tokens=4)
    ids = np.full((1, L, T, K), -1, dtype=np.int64)
    ids[..., 0], ids[..., 1] = 0, 2
    w.add_request(topk=ids, lengths=[10])
    ids[..., 1] = 3
    with pytest.raises(ValueError, match=r"id 3 is outside \[0, 3\) \(ids of 4 tokens over a length of 10\)"):
        w.add_request(topk=ids, lengths=[10])
    assert len(w.requests) == 1
    path = tmp_path / "units.safetensors"
    w.write(str(path))
    md, _ = ess_trace.read_trace(str(path))
    assert md["ess.unit_tokens"] == "4" and md["ess.version"] == "2"
    with pytest.raises(ValueError, match="unit_tokens 0"):
        ess_trace.TraceWriter(model="m", layers=L, mtp=T, topk=K, provenance="t", synthetic=False, unit_tokens=0)
