"""The coordinator's stream order, recorded on a device whose streams and events log what is asked of them
(work still runs at once, on the CPU): the order upstream's HiSparseCoordinator keeps, which the CUDA
backend relies on and the CPU replay cannot see.

- the backup of a step's newest entries runs on decode_backup_stream after it waited for the schedule
  stream and for the producer (forward) stream, and records the backup event after the write-back;
- the forward (model_runner._forward_raw, on the forward stream) waits for that event before its KV write;
- request_finished makes the schedule stream wait for the producer stream and the pending backup before
  it releases the request in ESS on that stream (no host wait);
- the staging copy runs on write_staging_stream after waiting for an event recorded on the schedule stream;
- the top-k recorder's copy (ESS_RECORD_TRACE) runs on decode_backup_stream after the schedule and producer
  streams, and the next forward waits for it."""
import pytest
import torch

from ess.integrations import _device
from ess.integrations import sglang as adapter
from recording_device import RecordingDevice
from test_sglang_replay import World


class StreamWorld(World):
    """The forward runs on the producer stream the scheduler handed the coordinator."""

    def forward(self, batch):
        with self.coord.dev.stream(self.coord.decode_producer_stream):
            super().forward(batch)


def recorded_world(monkeypatch, seed, cls=StreamWorld, prompts=(40, 70)):
    """A world of `cls` on a recording device, its requests prefilled and in decode."""
    monkeypatch.setattr(_device, "for_device", lambda device: RecordingDevice(device))
    w = cls(seed)
    for n in prompts:
        w.prefill(n)
    w.collect()
    return w


@pytest.fixture
def world(monkeypatch):
    return recorded_world(monkeypatch, 11)


def preceding(entries, i, stream):
    """The waits on `stream` between its previous launch and entry i."""
    waits = []
    for e in reversed(entries[:i]):
        if e[0] == "launch" and e[1] is stream:
            break
        if e[0] in ("wait_stream", "wait_event") and e[1] is stream:
            waits.append(e)
    return waits


def test_backups_wait_for_schedule_and_producer_and_the_forward_waits_for_them(world):
    coord, log = world.coord, world.coord.dev.log
    producer, backup = coord.decode_producer_stream, coord.decode_backup_stream
    for _ in range(3):
        world.step()
    entries = log.entries
    launches = [i for i, e in enumerate(entries) if e[0] == "launch" and e[1] is backup]
    assert len(launches) == 2, "steps 1 and 2's newest entries are backed up by the next step"
    for i in launches:
        waits = preceding(entries, i, backup)
        assert ("wait_stream", backup, producer) in waits
        assert any(w[0] == "wait_stream" and w[2].name == "schedule" for w in waits), waits
        # the backup event is recorded on the backup stream after the write-back ...
        j = next(k for k in range(i + 1, len(entries)) if entries[k][0] == "record")
        event = entries[j][1]
        assert event is coord._backup_done_event and entries[j][2] is backup
        # ... and the next forward's KV write (a swap launch on the producer stream) waits for it first.
        k = next(k for k in range(j + 1, len(entries)) if entries[k][0] == "launch" and entries[k][1] is producer)
        assert ("wait_event", producer, event) in entries[j + 1:k]


def test_request_finished_waits_before_it_releases(world, monkeypatch):
    coord, log = world.coord, world.coord.dev.log
    release = coord.engine.release

    def logged_release(idx):
        log.add("release", coord.dev.current_stream(), idx)
        release(idx)
    monkeypatch.setattr(coord.engine, "release", logged_release)
    world.step()
    world.step()
    world.prepare_decode()            # a backup in flight (a request finished or aborted before the forward)
    start = len(log.entries)
    world.finish(world.running[0])
    entries = log.entries[start:]
    kinds = [(e[0], getattr(e[1], "name", None)) for e in entries]
    schedule = coord.dev.current_stream()
    i_producer = entries.index(("wait_stream", schedule, coord.decode_producer_stream))
    i_backup = entries.index(("wait_event", schedule, coord._backup_done_event))
    # ESS's release is ordered on the schedule stream after both waits (on CUDA its work is enqueued there).
    i_release = next(i for i, e in enumerate(entries) if e[0] == "release")
    assert entries[i_release][1] is schedule
    assert i_producer < i_backup < i_release, kinds
    assert not any(e[0] in ("sync_event", "sync_stream") for e in entries), "a finish waited on the host"


def test_staging_copies_after_the_schedule_streams_event(world):
    log = world.coord.dev.log
    start = len(log.entries)
    world.prefill(30)
    entries = log.entries[start:]
    staging = world.coord.write_staging_stream
    i_copy = next(i for i, e in enumerate(entries) if e[0] == "launch" and e[1] is staging)
    start_event = next(e[1] for e in entries if e[0] == "record" and e[2].name == "schedule")
    assert ("wait_event", staging, start_event) in entries[:i_copy]
    assert any(e[0] == "record" and e[2] is staging for e in entries[i_copy:])


def test_the_recorders_copy_runs_after_the_forward_and_before_the_next(monkeypatch, tmp_path):
    monkeypatch.setenv("ESS_RECORD_TRACE", str(tmp_path / "t.safetensors"))
    w = recorded_world(monkeypatch, 12)
    coord, log = w.coord, w.coord.dev.log
    producer, backup = coord.decode_producer_stream, coord.decode_backup_stream
    for _ in range(3):
        w.step()
    entries = log.entries
    copies = [i for i, e in enumerate(entries) if e[0] == "launch" and e[2] == "record_copy"]
    # Step 1's preparation maps the requests that began; steps 1 and 2's top-k are copied at the next one's.
    assert len(copies) == 3
    for i in copies:
        assert entries[i][1] is backup
        waits = preceding(entries, i, backup)
        assert ("wait_stream", backup, producer) in waits
        assert any(e[0] == "wait_stream" and e[2].name == "schedule" for e in waits), waits
        j = next(k for k in range(i + 1, len(entries)) if entries[k][0] == "record" and entries[k][1] is
                 coord._backup_done_event)
        k = next(k for k in range(j + 1, len(entries)) if entries[k][0] == "launch" and entries[k][1] is producer)
        assert ("wait_event", producer, coord._backup_done_event) in entries[j + 1:k]


class SharedIndexStreamWorld(StreamWorld):
    SHARED = [False, True, True]


def test_shared_layers_steps_run_on_the_prefetch_stream_after_the_leaders_swap(monkeypatch):
    """GLM-5.2's index sharing (shared_index.py): after the leader's swap is enqueued, the prefetch stream waits for the
    forward's stream, runs the followers' steps and records one event per follower; each follower's swap only makes
    the forward's stream wait for its event (no swap of its own)."""
    w = recorded_world(monkeypatch, 13, SharedIndexStreamWorld)
    coord, log = w.coord, w.coord.dev.log
    producer, prefetch = coord.decode_producer_stream, coord.shared_index.stream
    start = len(log.entries)
    w.step()
    entries = log.entries[start:]
    swaps = [i for i, e in enumerate(entries) if e[0] == "launch" and e[2] == "swap"]
    assert len(swaps) == 1 and entries[swaps[0]][1] is producer, "only the leader swaps on the forward's stream"
    i = next(i for i, e in enumerate(entries) if e[0] == "launch" and e[1] is prefetch)
    assert i > swaps[0] and ("wait_stream", prefetch, producer) in preceding(entries, i, prefetch)
    records = [e[1] for e in entries[i:] if e[0] == "record" and e[2] is prefetch]
    assert len(records) == 2
    waits = [e for e in entries[i:] if e[0] == "wait_event" and e[2] in records]
    assert waits == [("wait_event", producer, records[0]), ("wait_event", producer, records[1])]


def test_a_dba_second_half_waits_for_the_other_micro_batchs_prefetch(monkeypatch):
    """The prefetch's steps use the engine's scratch set 1, as a DBA layer's second half does: with two-batch
    overlap, micro-batch A's leader starts its followers' steps and B's DBA second half at the same layer runs
    while they may still copy, so the forward's stream waits for the prefetch stream before that second half."""
    from test_sglang_replay import K, micro_batches
    monkeypatch.setenv("ESS_OVERLAP", "dba")

    class World3(StreamWorld):
        SHARED = [False, False, True]
    w = recorded_world(monkeypatch, 14, World3, (40, 70, 55, 90))
    coord, log = w.coord, w.coord.dev.log
    producer, prefetch, split = coord.decode_producer_stream, coord.shared_index.stream, coord.decode_split
    batch = w.prepare_decode()
    coord.wait_for_pending_backup()
    coord.num_real_reqs.fill_(len(batch.rids))
    with coord.dev.stream(producer):
        _, halves = micro_batches(w.rng, batch.idx, batch.seq_lens, 1)
        assert len(halves) == 2
        start = len(log.entries)
        for part_idx, part_lens, positions in halves:   # layer 1, A then B, each split in two by DBA
            bs = int(part_idx.shape[0])
            topk = torch.full((bs, K), -1, dtype=torch.int32)
            topk[:, 0] = 0
            split.armed = 1
            coord.swap_first_half(part_idx, part_lens, topk[:bs // 2], 1)
            coord.swap_in_selected_pages(part_idx, part_lens, topk, 1)
            split.armed, split.pending = None, None
    entries = log.entries[start:]
    swaps = [i for i, e in enumerate(entries) if e[0] == "launch" and e[2] == "swap"]
    assert len(swaps) == 4   # A's halves, B's halves
    assert ("wait_stream", producer, prefetch) not in preceding(entries, swaps[1], producer)
    assert ("wait_stream", producer, prefetch) in preceding(entries, swaps[3], producer)
    # ... and the other way: a DBA leader's followers wait for its second half's copy (on the DA copy stream,
    # reading scratch set 1 until copy_done) before their steps write set 1.
    prefetches = [i for i, e in enumerate(entries) if e[0] == "launch" and e[1] is prefetch]
    assert len(prefetches) == 2
    for i in prefetches:
        assert ("wait_event", prefetch, split.copy_done) in preceding(entries, i, prefetch)


def test_a_follower_its_leader_did_not_swap_for_waits_for_the_prefetch_stream(monkeypatch):
    """A dense leader's whole batch, then two-batch overlap's micro-batches at its followers (a pairing SGLang
    refuses with index sharing): the whole-batch prefetch serves neither micro-batch, and each follower's own swap
    runs after the prefetch stream's work on the same layer."""
    from test_sglang_replay import DenseLeaderTboWorld

    class World(DenseLeaderTboWorld):
        def forward(self, batch):
            with self.coord.dev.stream(self.coord.decode_producer_stream):
                super().forward(batch)
    w = recorded_world(monkeypatch, 15, World, (40, 70, 55, 90))
    coord, log = w.coord, w.coord.dev.log
    producer, prefetch = coord.decode_producer_stream, coord.shared_index.stream
    start = len(log.entries)
    w.step()
    entries = log.entries[start:]
    i_prefetch = next(i for i, e in enumerate(entries) if e[0] == "launch" and e[1] is prefetch)
    swaps = [i for i, e in enumerate(entries) if e[0] == "launch" and e[2] == "swap" and i > i_prefetch]
    assert swaps, "the followers swap themselves"
    assert ("wait_stream", producer, prefetch) in preceding(entries, swaps[0], producer)
    assert w.coord.shared_index.prefetched == 0
