"""The target's model calls, on one rank or on every rank of a tensor-parallel group.

The engine (rank 0) does all scheduling and acceptance and calls only
:meth:`ModelRunner.forward` and :meth:`ModelRunner.copy_slots` (and reads the captured
features with :meth:`ModelRunner.read_features`). With tensor
parallelism :class:`TPRunner` first broadcasts each call (its CPU inputs, packed
into int64 words by ``calls.py``, over a gloo control group) to the other ranks,
which run :func:`serve_calls`: the same call on their shard. The collectives
inside the model then keep the ranks in step, and every rank ends with the full
logits.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from splitspec.attention.base import AttentionBackend
from splitspec.cuda_graphs import StepGraphs
from splitspec.kv_cache import KVCache
from splitspec.model.layers import AttentionContext
from splitspec.model.llama import LlamaForCausalLM
from splitspec.staging import reuse
from target_service.calls import CallChannel, ForwardBatch

log = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, KV cache and attention backend."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend,
                 device: torch.device | str) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device
        self.graphs: StepGraphs | None = None  # set by the capture_cuda_graphs step
        self.last_graphed = False  # whether the last forward replayed a graph
        self._staging = torch.empty(0)  # pinned rows for read_features (splitspec.staging.reuse)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logit_rows), V] float32; the captured features (``batch.capture``) go to
        the cache's, where it keeps them (rank 0 of a target serving an EAGLE-3 draft)."""
        plan = (self.graphs.plan(batch.attn, batch.logit_rows, batch.capture)
                if self.graphs is not None else None)
        self.last_graphed = plan is not None
        if plan is not None:
            with torch.inference_mode():
                return self.graphs.run_plan(plan, batch.ids, batch.positions, batch.attn,
                                            batch.logit_rows)
        meta = self.backend.plan(batch.attn, self.device)
        ctx = AttentionContext(self.backend, meta, self.cache)
        with torch.inference_mode():
            out = self.model(batch.ids.to(self.device), batch.positions.to(self.device), ctx,
                             batch.capture)
            rows = torch.tensor(batch.logit_rows, device=self.device)
            return self.model.compute_logits(out.hidden[rows])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V (and the features the cache keeps) of global cache slots src to dst (KV
        compaction after acceptance)."""
        self.cache.copy_slots(src.to(self.device), dst.to(self.device))

    @property
    def feature_row_bytes(self) -> int:
        """Bytes of one slot's captured features (rank 0 of a target serving EAGLE-3)."""
        features = self.cache.features
        return features.shape[1] * features.element_size() if features is not None else 0

    def read_features(self, slots: list[int], into: np.ndarray | None = None) -> torch.Tensor:
        """The captured features at global ``slots`` ([len(slots), width] on the host): one
        gather and one copy, into ``into`` (bytes on the host: the draft's feature memory,
        page-locked where the cache is on a GPU) when given. Rank 0's own (no other rank
        keeps them): nothing to announce.

        Otherwise from a GPU the copy goes to pinned memory that the next call reuses, so the
        caller must be done with the rows by then (the engine puts them in the draft request
        at once). A copy to pageable memory ran at a twentieth of the speed on an H200 host
        (32 against 1.3 ms for a catch-up's 49 MiB; docs/benchmarks.md, thirty-second part)."""
        if self.cache.features is None:
            raise RuntimeError("this target keeps no captured features (no EAGLE-3 draft)")
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        rows = self.cache.features.index_select(0, index)
        if into is not None:
            out = torch.from_numpy(into).view(rows.dtype).view(rows.shape)
            out.copy_(rows)  # (to the host: returns once it is there)
            return out
        if rows.device.type != "cuda":
            return rows
        if self._staging.shape[1:] != rows.shape[1:] or self._staging.dtype != rows.dtype:
            self._staging = rows.new_empty((0, rows.shape[1]), device="cpu")
        self._staging = reuse(self._staging, len(slots), pin=True)
        staging = self._staging[:len(slots)]
        staging.copy_(rows)  # (to the host: returns once it is there)
        return staging

    def stop(self) -> None:
        """Release the other ranks (nothing to do on one rank)."""


class TPRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group: every call is broadcast before it runs here."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend,
                 device: torch.device | str, control: object) -> None:
        super().__init__(model, cache, backend, device)
        self.channel = CallChannel(control)

    def _announce(self, call: str, payload: object) -> None:
        self.channel.send(call, payload)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._announce("forward", batch)
        return super().forward(batch)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._announce("copy_slots", (src.cpu(), dst.cpu()))
        super().copy_slots(src, dst)

    def stop(self) -> None:
        self._announce("stop", None)


def serve_calls(runner: ModelRunner, control: object) -> None:
    """Ranks 1..N-1: run every call rank 0 broadcasts, until it says stop."""
    channel = CallChannel(control)
    while True:
        call, payload = channel.receive()
        if call == "stop":
            log.info("rank 0 said stop")
            return
        if call == "forward":
            runner.forward(payload)
        else:  # calls.decode knows three calls and refuses any other kind
            runner.copy_slots(*payload)
