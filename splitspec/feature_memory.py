"""EAGLE-3 features through shared memory, for a draft on the target's host.

On the Exchange stream the features cost about 2 ms a MB (docs/benchmarks.md, thirty-first
part); at 32 streams of an 8B-shaped target a step carries several MB. Where the draft can map
the target's memory, a request carries only where each sequence's features lie
(``SeqDraftInput.hidden_states_at``) in a segment the target wrote
(``DraftRequest.feature_memory``).

The target makes one segment per stream it opens: an anonymous memfd, which the draft opens
through ``/proc/<target pid>/fd/<fd>``. It goes when the target exits, so nothing is left
behind, and a draft in another container or on another host cannot open it, which
``AttachFeatureMemory`` finds out before the stream is used; the features then travel on the
stream. For a draft in another container on the same host, the target makes it instead as a
file in a directory both see (``--feature-memory-dir``: a tmpfs volume both mount at the same
path), and removes the file's name as soon as the draft has opened it (the first reply to a
request that named it), so a target that dies leaves nothing behind there either. A fresh
segment per stream means that a draft still reading for a stream the target
gave up on never sees its features rewritten. Within a stream the requests' regions form a
ring: a region is written again only after the reply to its request, or to a later one,
arrived. The draft answers in order and copies the features out before it replies.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger(__name__)

CHECK_BYTES = 16  # the segment starts with these random bytes: the draft checks it opened ours
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class Segment(NamedTuple):
    """A shared segment this process made (:func:`make_segment`): its descriptor, the path
    another process on this host opens it by, its mapping, and whether that path is a
    file's name in a directory (removed once the other side has opened it)."""

    fd: int
    path: str
    map: mmap.mmap
    named: bool


def make_segment(size: int, directory: str, name: str) -> Segment:
    """``size`` bytes of shared memory: an anonymous memfd (opened elsewhere through
    ``/proc/<pid>/fd/<fd>``), or with ``directory`` a file there named after ``name``, its
    pages allocated now (a full tmpfs fails here, not with SIGBUS at a write). OSError when
    it cannot be made; nothing is left behind then."""
    if directory:
        fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=directory)
    else:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        path = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        if directory:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return Segment(fd, path, mmap.mmap(fd, size), bool(directory))
    except OSError:  # (re-raised) a full or read-only directory: nothing left there
        if directory:
            os.unlink(path)
        os.close(fd)
        raise


def unlink_segment(path: str, what: str) -> None:
    """Remove a file segment's name from its directory (the other side has opened it, or
    never will): the mappings keep its memory until they go."""
    try:
        os.unlink(path)
    except FileNotFoundError:  # removed by someone else: the memory stays ours
        log.warning("the %s %s was already gone from its directory", what, path)


class FeatureRing:
    """The target's segment of ``size`` bytes, written as a ring of request regions: an
    anonymous memfd, or with ``directory`` a file there (OSError when it cannot be made)."""

    def __init__(self, size: int, directory: str = "") -> None:
        if size <= CHECK_BYTES:
            raise ValueError(f"feature memory of {size} bytes holds no features")
        self.size = size
        self._fd, self.path, self._map, self.named = make_segment(size, directory,
                                                                  "splitspec-features")
        self.array = np.frombuffer(self._map, dtype=np.uint8)  # the segment, writable
        self.pinned = False  # page-locked for CUDA (pin)
        self.check = os.urandom(CHECK_BYTES)
        self._map[:CHECK_BYTES] = self.check
        self._held: deque[tuple[int, int, int]] = deque()  # (key, start, end), oldest first
        self._first_key: int | None = None  # the first request given room: the draft opens
        # the segment when it reads that request, so a file's name goes with its reply

    def pin(self) -> str:
        """Page-lock the segment for CUDA, so that a GPU's copies write into it directly (at
        device speed; to unlocked memory they went at a twentieth of it) and its pages are
        all allocated now, not at a catch-up's first write into them (25 us a 24 KiB row on
        the H200's host; docs/benchmarks.md, thirty-fifth part): "" once done, or why not.
        Portable: locked for every device's context, not only the calling thread's current
        one (the draft link pins a reconnected stream's segment on its reconnect thread)."""
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(self.array.ctypes.data, self.size,
                                        CUDA_HOST_REGISTER_PORTABLE)
        if error != cudart.cudaError.success:
            return f"cudaHostRegister of {self.size} bytes failed: {error}"
        self.pinned = True
        return ""

    def put(self, data: np.ndarray, key: int) -> int | None:
        """Write ``data`` for the request numbered ``key`` (the requests of a stream in the
        order sent): its offset, or None when the ring has no room for it until replies free
        some (or ever)."""
        start = self.reserve(data.nbytes, key)
        if start is not None:
            raw = np.ascontiguousarray(data).view(np.uint8)
            self.array[start:start + data.nbytes] = raw.reshape(-1)
        return start

    def reserve(self, size: int, key: int) -> int | None:
        """Hold ``size`` bytes for the request numbered ``key``, for the caller to write
        (``array[offset:offset + size]``): their offset, or None as for :meth:`put`."""
        start = self._room(size) if size else None
        if start is not None:
            self._held.append((key, start, start + size))
            if self._first_key is None:
                self._first_key = key
        return start

    def _room(self, size: int) -> int | None:
        if not self._held:
            return CHECK_BYTES if CHECK_BYTES + size <= self.size else None
        first, last = self._held[0][1], self._held[-1][2]
        if last > first:  # the held regions run from first to last: room after, or at the start
            if last + size <= self.size:
                return last
            return CHECK_BYTES if CHECK_BYTES + size <= first else None
        return last if last + size <= first else None  # wrapped: room between them only

    def replied(self, key: int) -> None:
        """The reply to request ``key`` arrived: its region and earlier ones are free, and
        once it answers the first request given room, a file's name goes (:meth:`unlink`:
        the draft holds the file open since it read that request)."""
        while self._held and self._held[0][0] <= key:
            self._held.popleft()
        if self.named and self._first_key is not None and key >= self._first_key:
            self.unlink()

    @property
    def held_bytes(self) -> int:
        return sum(end - start for _, start, end in self._held)

    def unlink(self) -> None:
        """Remove a file segment's name from its directory (the draft has opened it, or never
        will): the mappings keep its memory until they go. Nothing for a memfd."""
        if self.named:
            self.named = False
            unlink_segment(self.path, "feature memory")

    def close(self) -> None:
        """Unlock and let the segment go: it is unmapped once no view of :attr:`array` is
        held (the draft's mapping keeps its pages until it lets go too)."""
        if self.pinned:
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostUnregister(self.array.ctypes.data)
            if error != cudart.cudaError.success:  # (the pages stay locked until exit)
                log.warning("cudaHostUnregister of the feature memory %s failed: %s",
                            self.path, error)
            self.pinned = False
        self.unlink()
        self.array = np.empty(0, dtype=np.uint8)
        self._map = None
        os.close(self._fd)


class FeatureMap:
    """The draft's read-only view of a target's segment."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # what read() slices

    def check(self, expected: bytes) -> None:
        """ValueError when the segment does not start with the target's check bytes."""
        if self._map[:CHECK_BYTES] != expected:
            raise ValueError(f"{self.path} is not the target's feature memory (its first "
                             f"{CHECK_BYTES} bytes differ from the ones the target wrote)")

    def read(self, offset: int, length: int) -> np.ndarray:
        """The ``length`` bytes at ``offset``, read-only and not copied: the reader copies
        them where they go before it replies to their request, after which the target may
        write them again (a fresh copy here cost more than the rest of a catch-up: a new
        allocation's pages are faulted in, docs/benchmarks.md, thirty-fifth part);
        ValueError when they are not in the segment."""
        if offset < CHECK_BYTES or offset + length > len(self._bytes):
            raise ValueError(f"features at {offset}..{offset + length} are outside the "
                             f"{len(self._bytes)}-byte feature memory {self.path}")
        return self._bytes[offset:offset + length]

    def close(self) -> None:
        """Let the segment go: it is unmapped once no view :meth:`read` gave is held (a
        view outliving its request reads whatever the target wrote there since)."""
        self._bytes = np.empty(0, dtype=np.uint8)
        self._map = None
