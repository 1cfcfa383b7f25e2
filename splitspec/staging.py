"""A device tensor's host twin, for inputs refilled on the host before every replay.

A CUDA graph reads fixed device tensors, so each replay's inputs are written on the host
and copied into them. Written into a pinned twin, they go in one asynchronous copy; but the
twin must not be rewritten before that copy has read it, so each refill first waits for
the event recorded after the last copy (long done, in a serving loop: the wait costs
nothing there). The step graphs (splitspec/cuda_graphs.py), the table prefix
(splitspec/attention/decode_table.py) and the draft's catch-up chain
(draft_service/tree_search.py) stage their inputs this way. Off CUDA the twin is plain
memory and there is nothing to wait for.
"""

from __future__ import annotations

import numpy as np
import torch


class HostTwin:
    """``target``'s twin on the host (pinned on CUDA): :meth:`wait`, write :attr:`host` (or
    :attr:`array`, its numpy view), then :meth:`send`."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        cuda = target.device.type == "cuda"
        self.host = torch.zeros(target.shape, dtype=target.dtype, pin_memory=cuda)
        self.array: np.ndarray = self.host.numpy()
        self._sent = torch.cuda.Event() if cuda else None

    def wait(self) -> None:
        """Until the last :meth:`send`'s copy has read the host twin (at once if none)."""
        if self._sent is not None:
            self._sent.synchronize()

    def send(self, record: bool = True) -> None:
        """Copy the host twin into the target, asynchronously on the current stream; with
        ``record=False`` no event is recorded, for a twin whose copy the next recorded
        send's event covers (the same stream, copied before it)."""
        self.target.copy_(self.host, non_blocking=True)
        if record and self._sent is not None:
            self._sent.record()


def reuse(buffer: torch.Tensor, rows: int, pin: bool) -> torch.Tensor:
    """``buffer``, a host buffer kept across calls, when it has ``rows`` rows; else a new one
    of its row shape and dtype, at least twice as long (pinned with ``pin``), so that it is
    rarely made again: memory just allocated is faulted in as it is first written, which on
    the H200's host cost more than the copies themselves (docs/benchmarks.md, thirty-fifth
    part)."""
    if buffer.shape[0] >= rows:
        return buffer
    return torch.empty((max(rows, 2 * buffer.shape[0]), *buffer.shape[1:]), dtype=buffer.dtype,
                       pin_memory=pin)


class RowStaging:
    """Byte rows bound for ``device``, gathered into one host buffer that every call reuses
    (pinned on CUDA, grown as needed) and sent in one copy: the draft's eager catch-up's
    features. Gathered into fresh host memory instead, a catch-up's rows cost about 20 us
    each on the H200's host, most of it faulting the new pages in (docs/benchmarks.md,
    thirty-fifth part). As with :class:`HostTwin`, a call first waits for the last one's copy
    to have read the buffer. Off CUDA the result is a copy of its own."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._sent = torch.cuda.Event() if self._cuda else None

    def send(self, parts: list[np.ndarray]) -> torch.Tensor:
        """``parts`` (uint8 arrays) one after another on the device: uint8 [their bytes]."""
        total = sum(part.nbytes for part in parts)
        if self._sent is not None:
            self._sent.synchronize()
        self._host = reuse(self._host, total, self._cuda)
        host = self._host.numpy()
        at = 0
        for part in parts:
            host[at:at + part.nbytes] = part.reshape(-1)
            at += part.nbytes
        if not self._cuda:
            return self._host[:total].to(self.device, copy=True)
        sent = self._host[:total].to(self.device, non_blocking=True)
        self._sent.record()
        return sent
