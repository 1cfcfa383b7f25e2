"""From committed token ids to client text: incremental detokenization plus
stop strings with hold-back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from splitspec.tokenizer import IncrementalDetokenizer, ModelTokenizer


class StopResult(NamedTuple):
    text: str         # safe to send now
    is_stopped: bool  # a stop string matched; text ends just before it


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could start one.

    Invariant: text already returned never contains a stop string and never
    ends with a proper prefix of one, so a match is always found inside the
    held-back buffer plus the new text. After a match the matcher is done and
    returns nothing more.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop_strings)
        self._held = ""
        self.is_stopped = False

    def push(self, text: str) -> StopResult:
        """Add text; return what can be sent, and whether a stop string matched."""
        if self.is_stopped:
            return StopResult("", True)
        buffer = self._held + text
        match_at = self._first_match(buffer)
        if match_at is not None:
            self._held = ""
            self.is_stopped = True
            return StopResult(buffer[:match_at], True)
        num_held = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return StopResult(buffer[:len(buffer) - num_held], False)

    def finish(self) -> str:
        """Release the held-back text (generation ended without a match)."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _first_match(self, buffer: str) -> int | None:
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class TextPiece(NamedTuple):
    text: str         # new text to send
    is_stopped: bool  # a stop string matched: the token that completed it was the last one used


class TextStream:
    """Token ids in, client text out: detokenizer followed by the stop matcher.

    Tokens are taken one at a time so that a stop match tells exactly how many
    tokens were used (:attr:`num_tokens`); tokens after the match are ignored.
    """

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: Sequence[int],
                 stop_strings: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopMatcher(stop_strings)
        self.token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Tokens used so far (all pushed tokens up to and including a stop match)."""
        return len(self.token_ids)

    @property
    def is_stopped(self) -> bool:
        return self._stop.is_stopped

    def push(self, token_ids: Sequence[int]) -> TextPiece:
        """Add tokens; return the text that can be sent now."""
        pieces = []
        for token_id in token_ids:
            if self._stop.is_stopped:
                break
            self.token_ids.append(token_id)
            pieces.append(self._stop.push(self._detokenizer.push([token_id])).text)
        return TextPiece("".join(pieces), self._stop.is_stopped)

    def finish(self) -> str:
        """The text still held back, once generation has ended without a stop match."""
        if self._stop.is_stopped:
            return ""
        tail = self._stop.push(self._detokenizer.finish())
        return tail.text + ("" if tail.is_stopped else self._stop.finish())
