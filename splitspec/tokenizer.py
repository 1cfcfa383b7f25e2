"""The model's tokenizer (Hugging Face ``tokenizer.json``), its fingerprint, and
incremental detokenization.

The gateway and the target must tokenize alike: both compute
:func:`tokenizer_sha256` of their checkpoint's ``tokenizer.json`` and the
gateway refuses to start when the two differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the first new tokens, so that a leading
# space ("▁word" in SentencePiece-style vocabularies) comes out right.
PROMPT_CONTEXT_TOKENS = 5


def tokenizer_sha256(model_dir: Path) -> str:
    """Hex sha256 of the bytes of ``model_dir/tokenizer.json``."""
    return hashlib.sha256((Path(model_dir) / TOKENIZER_FILE).read_bytes()).hexdigest()


@dataclass(frozen=True)
class ModelTokenizer:
    """A loaded ``tokenizer.json`` with where it came from and its fingerprint.

    Encoding adds the special tokens the tokenizer's own post-processor adds (a Llama
    checkpoint's BOS, as Hugging Face's tokenizers, vLLM and SGLang do by default for a text
    prompt; the built-in tokenizer adds none), unless told not to (a prompt that already
    holds them); decoding skips them (EOS is not text).
    Safe to share between threads.
    """

    path: Path
    sha256: str
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> ModelTokenizer:
    """Load ``model_dir/tokenizer.json``; FileNotFoundError names what is missing (the
    folder, or the file in it)."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"{model_dir} is not a folder: pass --model <checkpoint folder "
                                f"with {TOKENIZER_FILE}>")
    if not path.is_file():
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} in {model_dir}: pass --model <checkpoint folder with {TOKENIZER_FILE}>")
    return ModelTokenizer(path=path, sha256=tokenizer_sha256(model_dir),
                          tokenizer=Tokenizer.from_file(str(path)))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, one push at a time.

    The prefix-offset / read-offset technique: ``ids[prefix:read]`` is a window
    that was already emitted; decoding ``ids[prefix:]`` and cutting off the
    window's text gives the new text. Text is emitted only when it does not end
    in U+FFFD, i.e. when no token boundary split a UTF-8 character; the window
    then slides forward. Invariant: the pieces returned by :meth:`push` and
    :meth:`finish`, concatenated, equal the decode of all pushed ids (seen in
    the context of the prompt's last tokens), and :meth:`push` never returns
    text that ends in a partial character.
    """

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def finish(self) -> str:
        """Return whatever text is still held back (a partial character decodes as U+FFFD)."""
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        prefix_text = self._tokenizer.decode(window[:self._read_offset - self._prefix_offset])
        return prefix_text, self._tokenizer.decode(window)
