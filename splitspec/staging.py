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
