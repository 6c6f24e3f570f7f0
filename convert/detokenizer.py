"""Streaming text out of token ids as they arrive (`Tokenizer.stream`). Host-only module."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Streams text while tokens arrive, never emitting a partial UTF-8 character.

        det = tok.stream(prompt_len=len(prompt_ids))
        for ...:  ids.append(next_id); print(det.step(ids), end="")
        print(det.flush())

    `step(ids)` takes all ids so far (prompt included; the first `prompt_len` are never
    emitted) and returns the new printable text. It decodes a short window
    ids[prefix:] and compares it with ids[prefix:read] (the text already emitted plus a few
    tokens of context), so decoders that drop a leading space still produce the right text:
        ids [p0 p1 | t0 t1 t2],  prefix=0, read=2  ->  emit decode(p0..t2)[len(decode(p0 p1)):]
    Text ending in U+FFFD (an incomplete UTF-8 sequence: a byte token or a byte-level token
    that cuts a character) is held back until later tokens complete it; `flush()` emits
    whatever is left (then a real invalid byte shows as U+FFFD). The concatenation of all
    returns equals decode(ids[prompt_len:]) for concatenative decoders (byte-level, Gemma).
    """

    _CONTEXT = 5  # tokens of prompt decoded with the first new token

    def __init__(self, tokenizer, prompt_len: int = 0, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._prefix = max(0, prompt_len - self._CONTEXT)
        self._read = prompt_len
        self._ids: list[int] = []

    def _texts(self, ids: Sequence[int]) -> tuple[str, str]:
        before = self._tok.decode(ids[self._prefix : self._read], self._skip)
        return before, self._tok.decode(ids[self._prefix :], self._skip)

    def step(self, ids: Sequence[int]) -> str:
        self._ids = list(ids)
        if len(self._ids) <= self._read:
            return ""
        before, text = self._texts(self._ids)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    __call__ = step

    def flush(self) -> str:
        """The held-back rest (possibly ending in U+FFFD); the stream is then at its end."""
        if len(self._ids) <= self._read:
            return ""
        before, text = self._texts(self._ids)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
