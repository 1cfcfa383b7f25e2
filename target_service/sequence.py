"""One request inside the target: its tokens, cache pages and draft bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitspec.kv_cache import PageTable
from splitspec.sampling import SamplingParams
from splitspec.spec_stats import SpecCounters
from splitspec.v1 import common_pb2


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: int
    stream_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    speculation: int  # common_pb2.SpeculationMode
    table: PageTable
    seq_id: int  # unique within this target process (the draft's key)
    sampling: SamplingParams = SamplingParams()
    span: object = None  # the sequence's span (splitspec.telemetry), ended when it finishes
    arrived_at: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated
    num_cached: int = 0       # tokens whose K/V is in the cache (= len(tokens) - 1 once running)
    draft_synced: int = 0     # committed tokens the draft has seen
    spec: SpecCounters = field(default_factory=SpecCounters)
    queue_s: float = 0.0
    is_cancelled: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def is_prefilled(self) -> bool:
        return self.num_cached > 0

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append generated tokens up to the first stop condition; returns those kept.

        Sets finish_reason when a stop id is produced (kept) or max_new_tokens is reached.
        """
        kept = []
        for token in new_tokens:
            self.tokens.append(token)
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = common_pb2.FINISH_REASON_EOS
                break
            if self.num_generated >= self.max_new_tokens:
                self.finish_reason = common_pb2.FINISH_REASON_LENGTH
                break
        return kept
