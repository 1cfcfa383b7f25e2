"""EAGLE-3 features through shared memory (splitspec.feature_memory): the target's ring never
rewrites a region before the draft replied to its request, and through a real gRPC server
every sequence's features reach the drafter byte for byte, through the memory or, where it
has no room or the draft cannot read it, on the stream."""

from __future__ import annotations

import logging
import os
import time

import grpc
import numpy as np
import pytest

from draft_service.drafter import EMPTY_TREE, SeqResult
from draft_service.servicer import DraftServicer
from splitspec.feature_memory import CHECK_BYTES, FeatureMap, FeatureRing
from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.init_report import InitReport
from splitspec.v1 import draft_pb2, draft_pb2_grpc
from target_service.draft_client import DraftLink, Features
from tests.stack import serve_draft_in_process

ROW = 8  # bytes a row in these tests: 4 bfloat16 values


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, ROW), dtype=np.uint8)


def test_the_ring_writes_a_region_again_only_after_its_reply():
    ring = FeatureRing(CHECK_BYTES + 100)
    try:
        view = FeatureMap(ring.path)
        view.check(ring.check)
        first, second = rows(5, 0), rows(5, 1)
        assert ring.put(first, 0) == CHECK_BYTES
        assert ring.put(second, 1) == CHECK_BYTES + 40
        assert ring.put(rows(5, 2), 2) is None  # 20 bytes left at the end; the start is held
        ring.replied(0)
        third = rows(5, 2)
        assert ring.put(third, 2) == CHECK_BYTES  # wrapped to the start, before the 2nd
        assert ring.put(rows(1, 3), 3) is None    # only the 2nd's region is past the 3rd
        assert view.read(CHECK_BYTES + 40, 40).tobytes() == second.tobytes()  # not rewritten
        assert view.read(CHECK_BYTES, 40).tobytes() == third.tobytes()
        ring.replied(1)
        assert ring.put(rows(5, 4), 3) == CHECK_BYTES + 40
        assert ring.held_bytes == 80
        ring.replied(3)
        assert ring.held_bytes == 0
        assert ring.put(rows(13, 5), 4) is None  # larger than the whole ring
        assert ring.put(rows(0, 6), 4) is None   # nothing to write
        view.close()
    finally:
        ring.close()


def test_a_read_is_a_view_of_the_memory_not_a_copy_and_outlives_close():
    ring = FeatureRing(CHECK_BYTES + 64)
    try:
        view = FeatureMap(ring.path)
        first = rows(2, 0)
        offset = ring.put(first, 0)
        seen = view.read(offset, 2 * ROW)
        assert not seen.flags.writeable and seen.tobytes() == first.tobytes()
        ring.replied(0)
        again = rows(2, 1)
        assert ring.put(again, 1) == offset
        assert seen.tobytes() == again.tobytes()  # the target's new rows show through it
        view.close()
        assert seen.tobytes() == again.tobytes()  # still mapped while a view is held
    finally:
        ring.close()


def test_reads_are_checked():
    ring = FeatureRing(CHECK_BYTES + 64)
    try:
        view = FeatureMap(ring.path)
        with pytest.raises(ValueError, match="is not the target's feature memory"):
            view.check(bytes(CHECK_BYTES))
        with pytest.raises(ValueError, match="outside the 80-byte feature memory"):
            view.read(CHECK_BYTES + 60, 8)
        with pytest.raises(ValueError, match="outside"):
            view.read(0, 8)  # the check bytes are not features
        view.close()
    finally:
        ring.close()


class Recorder:
    """A drafter that keeps the features each sequence brought and drafts nothing."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bytes]] = []

    def open_session(self) -> object:
        return object()

    def close_session(self, session: object) -> None:
        pass

    def draft(self, session, seqs, release_ids=()):
        # copied before the reply, as a drafter must (the memory's regions are written again)
        self.seen += [(item.seq_id, bytes(item.hidden_states)) for item in seqs]
        return [SeqResult(item.seq_id, EMPTY_TREE, "") for item in seqs]


class NoMemory(draft_pb2_grpc.DraftServicer):
    """A draft without AttachFeatureMemory (an older one): every call of it is UNIMPLEMENTED."""

    def __init__(self, inner: DraftServicer) -> None:
        self.Exchange = inner.Exchange


@pytest.fixture
def draft():
    recorder = Recorder()
    servicer = DraftServicer(recorder, draft_pb2.DraftInfo(needs_hidden_states=True),
                             InitReport("draft"))
    servers = []

    def start(wrapper=None) -> str:
        server, address = serve_draft_in_process(wrapper(servicer) if wrapper else servicer)
        servers.append(server)
        return address

    yield recorder, servicer, start
    for server in servers:
        server.stop(None)


def open_link(address: str, memory_bytes: int, pin: bool = False, directory: str = ""
              ) -> DraftLink:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    info = draft_pb2.DraftInfo(needs_hidden_states=True)
    return DraftLink(address, channel, info, timeout_s=5.0, feature_memory_bytes=memory_bytes,
                     pin_features=pin, feature_memory_dir=directory)


def request_of(step: int, counts: list[int]) -> tuple[draft_pb2.DraftRequest, Features]:
    request = draft_pb2.DraftRequest(step=step, seqs=[
        draft_pb2.SeqDraftInput(seq_id=10 * step + i, new_tokens=[1] * count)
        for i, count in enumerate(counts)])
    return request, Features(rows(sum(counts), step), counts, ROW // 2, "bfloat16")


def expected(request: draft_pb2.DraftRequest, features: Features) -> list[tuple[int, bytes]]:
    ends = np.cumsum(features.counts)
    return [(item.seq_id, features.rows[end - count:end].tobytes())
            for item, count, end in zip(request.seqs, features.counts, ends, strict=True)]


def test_features_reach_the_drafter_through_the_memory_as_its_ring_wraps(draft):
    recorder, _, start = draft
    link = open_link(start(), CHECK_BYTES + 50 * ROW)
    try:
        assert link.feature_memory.startswith("/proc/")
        for step in range(12):  # 6-24 rows a request in a ring of 50: it wraps every few
            request, features = request_of(step, [step % 4 + 1, 2 * step])
            recorder.seen.clear()
            result = link.receive(link.send(request, features))
            assert result.reply is not None and result.reply.step == step
            assert request.feature_memory == link.feature_memory
            assert all(item.HasField("hidden_states_at") and not item.hidden_states
                       and item.hidden_dim == ROW // 2 and item.dtype == "bfloat16"
                       for item in request.seqs)
            assert recorder.seen == expected(request, features)
    finally:
        link.close()


def test_features_written_into_a_slot_of_the_memory_reach_the_drafter(draft):
    """DraftLink.feature_slot: room held for the next request, which the target's cache is
    read into (as the engine does); the request then points at it, and nothing is copied."""
    recorder, _, start = draft
    link = open_link(start(), CHECK_BYTES + 50 * ROW)
    try:
        for step in range(8):  # 4-10 rows a request in a ring of 50: it wraps
            request, features = request_of(step, [step + 1, 3])
            slot = link.feature_slot(features.rows.nbytes)
            assert slot is not None and slot.rows.nbytes == features.rows.nbytes
            slot.rows[:] = features.rows.reshape(-1)
            written = features._replace(rows=slot.rows.reshape(features.rows.shape),
                                        offset=slot.offset)
            recorder.seen.clear()
            assert link.receive(link.send(request, written)).reply is not None
            assert all(item.hidden_states_at.offset >= slot.offset for item in request.seqs)
            assert recorder.seen == expected(request, features)
        assert link.feature_slot(51 * ROW) is None  # more than the whole ring
    finally:
        link.close()
    assert link.feature_slot(ROW) is None  # closed: no memory


def test_a_gpu_targets_memory_that_cannot_be_locked_takes_the_features_staged(
        draft, caplog, monkeypatch):
    """A GPU target's link page-locks the segment; where that fails (here: made to), it
    says why, offers no slots (a copy from the GPU into unlocked memory is slow) and puts
    the features into the memory itself, as a CPU target's link without slots would."""
    recorder, _, start = draft
    monkeypatch.setattr(FeatureRing, "pin", lambda ring: "cudaHostRegister failed: (test)")
    caplog.set_level(logging.INFO)
    link = open_link(start(), CHECK_BYTES + 50 * ROW, pin=True)
    try:
        assert link.feature_memory and "cudaHostRegister failed: (test)" in caplog.text
        assert link.feature_slot(4 * ROW) is None
        request, features = request_of(1, [3, 4])
        assert link.receive(link.send(request, features)).reply is not None
        assert request.feature_memory and recorder.seen == expected(request, features)
    finally:
        link.close()


def test_features_without_room_in_the_memory_travel_on_the_stream(draft):
    recorder, _, start = draft
    link = open_link(start(), CHECK_BYTES + 50 * ROW)
    try:
        big, big_features = request_of(1, [60])  # more than the whole ring
        first, first_features = request_of(2, [30])
        second, second_features = request_of(3, [30])  # sent before the first's reply
        sent = [link.send(big, big_features), link.send(first, first_features),
                link.send(second, second_features)]
        assert not big.feature_memory and big.seqs[0].hidden_states
        assert first.feature_memory and not first.seqs[0].hidden_states
        assert not second.feature_memory  # the first's 30 rows are held until its reply
        for one in sent:
            assert link.receive(one).reply is not None
        assert recorder.seen == [*expected(big, big_features), *expected(first, first_features),
                                 *expected(second, second_features)]
        third, third_features = request_of(4, [30])  # both replies are in: room again
        assert link.receive(link.send(third, third_features)).reply is not None
        assert third.feature_memory and recorder.seen[-1] == expected(third, third_features)[0]
    finally:
        link.close()


def test_a_reply_frees_only_its_own_request_and_earlier_ones(draft):
    recorder, _, start = draft
    link = open_link(start(), CHECK_BYTES + 50 * ROW)
    try:
        sent = [request_of(step, [20]) for step in (1, 2)]
        waiting = [link.send(request, features) for request, features in sent]
        assert all(request.feature_memory for request, _ in sent)
        assert link.receive(waiting[0]).reply is not None
        late, late_features = request_of(3, [25])  # fits only where the 2nd's rows still are
        waiting.append(link.send(late, late_features))
        assert not late.feature_memory
        for one in waiting[1:]:
            assert link.receive(one).reply is not None
        assert recorder.seen == [item for request, features in [*sent, (late, late_features)]
                                 for item in expected(request, features)]
    finally:
        link.close()


def test_a_draft_that_cannot_attach_gets_the_features_on_the_stream(draft, caplog):
    recorder, servicer, start = draft
    caplog.set_level(logging.INFO)
    link = open_link(start(NoMemory), 1 << 20)
    try:
        assert link.feature_memory == ""
        assert any("draft features travel on the stream, not through shared memory: "
                   "AttachFeatureMemory failed: UNIMPLEMENTED" in m for m in caplog.messages)
        request, features = request_of(1, [3, 4])
        assert link.receive(link.send(request, features)).reply is not None
        assert not request.feature_memory
        assert recorder.seen == expected(request, features)
    finally:
        link.close()
    # What the draft answers for memory it cannot read:
    missing = servicer.AttachFeatureMemory(
        draft_pb2.AttachFeatureMemoryRequest(path="/proc/0/fd/0", check=bytes(16)), None)
    assert missing.error.startswith("cannot open /proc/0/fd/0: ")
    ring = FeatureRing(1024)
    try:
        wrong = servicer.AttachFeatureMemory(
            draft_pb2.AttachFeatureMemoryRequest(path=ring.path, check=bytes(16)), None)
        assert "is not the target's feature memory" in wrong.error
        right = servicer.AttachFeatureMemory(
            draft_pb2.AttachFeatureMemoryRequest(path=ring.path, check=ring.check), None)
        assert right.error == ""
    finally:
        ring.close()


def test_no_memory_without_a_draft_that_needs_features(draft):
    _, _, start = draft
    address = start()
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    link = DraftLink(address, channel, draft_pb2.DraftInfo(), timeout_s=5.0,
                     feature_memory_bytes=1 << 20)
    try:
        assert link.feature_memory == ""
    finally:
        link.close()


def test_memory_that_cannot_be_made_leaves_the_features_on_the_stream(draft, caplog,
                                                                      monkeypatch):
    recorder, _, start = draft
    address = start()

    def no_memory(name, flags=0):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr("os.memfd_create", no_memory)
    link = open_link(address, 1 << 20)
    try:
        assert link.feature_memory == ""
        assert any("could not be made: [Errno 24] Too many open files" in m
                   for m in caplog.messages)
        request, features = request_of(1, [2])
        assert link.receive(link.send(request, features)).reply is not None
        assert recorder.seen == expected(request, features)
    finally:
        link.close()


def test_a_file_segment_leaves_its_directory_once_the_draft_has_opened_it(draft, tmp_path):
    """--feature-memory-dir (a tmpfs volume two containers share): each stream's segment is
    a file there, named to the draft, and its name goes with the first reply to a request
    that used it; the features go on through it, and a reopened stream makes a new one."""
    recorder, _, start = draft
    address = start()
    link = open_link(address, CHECK_BYTES + 50 * ROW, directory=str(tmp_path))
    try:
        path = link.feature_memory
        assert path.startswith(f"{tmp_path}/splitspec-features-")
        assert os.listdir(tmp_path) == [os.path.basename(path)]  # until the draft opens it
        plain = draft_pb2.DraftRequest(step=0)  # names no memory: the file stays
        assert link.receive(link.send(plain)).reply is not None
        assert os.listdir(tmp_path) == [os.path.basename(path)]
        for step in range(1, 8):  # it wraps
            request, features = request_of(step, [step + 1, 3])
            recorder.seen.clear()
            assert link.receive(link.send(request, features)).reply is not None
            assert request.feature_memory == path and recorder.seen == expected(request, features)
            assert os.listdir(tmp_path) == []
        link._break()  # as a broken stream: reconnected in the background, with a new segment
        assert link.down
        deadline = time.monotonic() + 10
        while link.down:
            assert time.monotonic() < deadline, "the link did not reconnect"
            time.sleep(0.02)
        request, features = request_of(9, [2])
        sent = link.send(request, features)
        assert sent.restarted and link.feature_memory != path
        assert link.receive(sent).reply is not None and os.listdir(tmp_path) == []
        assert recorder.seen[-1:] == expected(request, features)
    finally:
        link.close()
    assert os.listdir(tmp_path) == []
    refused = open_link(start(NoMemory), 1 << 20, directory=str(tmp_path))
    refused.close()
    assert os.listdir(tmp_path) == []  # a draft that cannot attach leaves nothing either
    gone = open_link(address, 1 << 20, directory=str(tmp_path / "missing"))
    try:
        assert gone.feature_memory == ""  # the features travel on the stream
    finally:
        gone.close()


def test_a_file_rings_name_goes_with_the_reply_to_the_first_request_given_room(tmp_path):
    ring = FeatureRing(CHECK_BYTES + 64, str(tmp_path))
    try:
        ring.replied(0)  # a request that used no room: the draft has not opened the file
        assert ring.named and os.listdir(tmp_path) == [os.path.basename(ring.path)]
        assert ring.put(np.zeros(8, dtype=np.uint8), 3) == CHECK_BYTES
        ring.replied(2)
        assert ring.named
        ring.replied(3)
        assert not ring.named and os.listdir(tmp_path) == []
        assert ring.put(np.ones(8, dtype=np.uint8), 4) is not None  # still writable
    finally:
        ring.close()
    assert os.listdir(tmp_path) == []
