"""Host state of one batch row (`RowState`): its prompt, generated ids, finish reason and
streamed text, and what the row is doing (`Phase`: free, prefilling, decoding). Its
fields are edited only through `decode.py` (the loop and the state edits) and `Slots`,
which hold the rows of a batch in `DecodeState`."""

from __future__ import annotations

import enum
from typing import Optional, Sequence


class Phase(enum.Enum):
    """What a row of the batch is doing, apart from why its request ended (`RowState.finish`).

    FREE: no request holds it (a `Slots` slot to insert into); PREFILLING: its request's
    prompt is still forwarded in chunks (`Slots(prefill_chunk=)`: neither free nor
    decoding); DECODING: its request is in the decode loop, live until `finish` is set;
    WARMING: no request holds it, but a prefix-cache warm job forwards a token sequence's
    blocks into the cache through it (`prefix_warm.PrefixWarm`: not free, never decoded,
    no tokens). A batch of `generate` is DECODING from its prefill on."""

    FREE = "free"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    WARMING = "warming"


def free_row(slot: int, tokenizer) -> "RowState":
    """The row of a slot no request holds (`Phase.FREE`)."""
    row = RowState(slot, [0], tokenizer, set(), (), 1, None)
    row.phase = Phase.FREE
    return row


def stop_holdback(text: str, end: int, stops, floor: int = 0) -> int:
    """The end of text[:end] that is safe to stream: a tail that could still grow into one of
    the stop strings (a proper prefix of it, no earlier than `floor`) is held back.
    # "ab<" with stop "<|end|>" -> 2"""
    for s in stops:
        for k in range(min(len(s) - 1, end - floor), 0, -1):
            if text[end - k:end] == s[:k]:
                end -= k
                break
    return end


class _FullDecode:
    """Streaming fallback for tokenizers without an incremental detokenizer: decodes the
    whole output each step (O(length) per step)."""

    def __init__(self, tokenizer):
        self.tok, self.sent = tokenizer, ""

    def step(self, ids) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        end = len(text)
        while end > len(self.sent) and text[end - 1] == "\ufffd":  # half a UTF-8 character
            end -= 1
        if not text.startswith(self.sent) or end <= len(self.sent):
            return ""
        out, self.sent = text[len(self.sent):end], text[:end]
        return out

    def flush(self) -> str:
        return ""


class RowState:
    """Host state of one batch row: generated ids, finish detection, streamed text.

    Text arrives through the tokenizer's incremental detokenizer (`Tokenizer.stream`:
    O(new tokens) per step); a tail that could still become a stop string is held back,
    and only verified tokens are ever turned into text. `text` is final once the row
    finishes (the decoded output, cut before the first stop string)."""

    def __init__(self, index, prompt_ids, tokenizer, eos_ids, stop, max_new, on_text):
        self.index, self.prompt_ids, self.tok = index, list(prompt_ids), tokenizer
        self.eos_ids, self.stop, self.max_new, self.on_text = eos_ids, stop, max_new, on_text
        self.ids: list = []
        self.logprobs: Optional[list] = None  # per generated id, when asked for (DecodeState.logprobs)
        # per prompt id, when its request asks (GenerationParams.prompt_logprobs = k): its
        # log-probability given the ids before it (None for the first), and with k > 0 the k
        # most likely ids there as (id, log-probability) pairs (`record_prompt_logprobs`)
        self.prompt_logprobs: Optional[list] = None
        self.prompt_top: Optional[list] = None
        self.prompt_k = 0
        # per generated id, with top_k > 0 (GenerationParams.top_logprobs): the top_k most
        # likely (id, log-probability) pairs where it was chosen
        self.top_k = 0
        self.tops: Optional[list] = None
        self.min_new = 0  # EOS / stop ids banned until this many tokens are out (min_new_tokens)
        # the row's own SamplingParams / Penalties (None: the batch's; DecodeState.set_row_values)
        self.sampling = self.penalties = None
        self.logit_bias: tuple = ()  # its (id, bias) pairs (GenerationParams.logit_bias)
        self.finish: Optional[str] = None  # why the request ended: "eos" | "stop" | "length" | "abort"
        self.phase = Phase.DECODING
        self.steps = 0
        self.retrieval: Optional[dict] = None  # a retrieval strategy's record of the request (Slots.free)
        self.text = ""
        self._buf = ""  # text of the ids so far (from the detokenizer)
        self._sent = 0  # characters of _buf handed to on_text
        stream = getattr(tokenizer, "stream", None)
        self._det = stream(0, skip_special_tokens=True) if callable(stream) else _FullDecode(tokenizer)

    def record_prompt_logprobs(self, start: int, lps, top_lps=None, top_ids=None) -> None:
        """A prefill block's prompt log-probabilities: the block began at cache slot
        `start`, and lps[p] is that of the id at slot start + p + 1 (top_lps / top_ids
        [P,k]: the most likely ids there). Takes those of prompt ids not yet recorded, in
        order (a chunked prompt's blocks overlap by one id; later blocks over generated
        ids, e.g. a rollback's re-prefill, add none)."""
        if self.prompt_logprobs is None:
            return
        for p in range(len(lps)):
            at = start + p + 1
            if at != len(self.prompt_logprobs) or at >= len(self.prompt_ids):
                continue
            self.prompt_logprobs.append(float(lps[p]))
            if self.prompt_k:
                self.prompt_top.append([(int(i), float(v)) for i, v in zip(top_ids[p][:self.prompt_k],
                                                                            top_lps[p][:self.prompt_k])])

    @property
    def live(self) -> bool:
        """Whether the decode loop steps this row: a request decoding, not finished."""
        return self.phase is Phase.DECODING and self.finish is None

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def accept(self, new: Sequence[int], logprobs: Optional[Sequence[float]] = None, tops=None) -> list:
        """Append emitted tokens (and their log-probabilities, when the row keeps them;
        tops: per token its most likely (id, log-probability) pairs, when it keeps them) up
        to EOS / stop / max length; returns those kept."""
        kept = []
        for t in new:
            if self.finish:
                break
            if len(self.ids) >= self.max_new:  # max_new 0: a request that scores its prompt only
                self.finish = "length"
                break
            t = int(t)
            kept.append(t)
            self.ids.append(t)
            if t in self.eos_ids:
                self.finish = "eos"
            elif len(self.ids) >= self.max_new:
                self.finish = "length"
        if not kept:
            return kept
        if self.logprobs is not None:
            self.logprobs += [float(x) for x in logprobs[:len(kept)]]
        if self.tops is not None:
            self.tops += [list(t)[:self.top_k] for t in tops[:len(kept)]]
        seen = len(self._buf)
        self._buf += self._det.step(self.ids)
        if self.stop and any(s in self._buf[max(0, seen - len(s) + 1):] for s in self.stop):
            # the shortest token prefix whose text holds a stop string (the detokenizer may
            # have held back a few tokens: look from a little before this step's tokens)
            first = len(self.ids) - len(kept)
            for n in range(max(1, first - 8), len(self.ids) + 1):
                if any(s in self._decode(self.ids[:n]) for s in self.stop):
                    break
            del kept[max(0, n - first):]
            del self.ids[n:]
            if self.logprobs is not None:
                del self.logprobs[n:]
            if self.tops is not None:
                del self.tops[n:]
            self.finish = "stop"
        if self.finish:
            text = self._decode(self.ids)
            if self.finish == "stop":
                text = text[: min(text.find(s) for s in self.stop if s in text)]
            self.text = text
            self._buf = text if text.startswith(self._buf[:self._sent]) else self._buf
        else:
            self.text = self._buf
        self._stream()
        return kept

    def _stream(self):
        if self.on_text is None:
            return
        text = self.text if self.finish else self._buf
        end = len(text) if self.finish else stop_holdback(text, len(text), self.stop, self._sent)
        if end > self._sent:
            self.on_text(self.index, text[self._sent:end])
            self._sent = end

    @property
    def streamed_text(self) -> str:  # the text already handed to on_text
        return self.text[:self._sent]

    def detach_stream(self):
        """Switch the row's own streaming off (a caller streams final text); its on_text."""
        on_text, self.on_text = self.on_text, None
        return on_text

    def truncate(self, n_ids: int) -> None:
        """Keep the first n_ids generated tokens (rollback); the row is live again."""
        del self.ids[n_ids:]
        if self.logprobs is not None:
            del self.logprobs[n_ids:]
        if self.tops is not None:
            del self.tops[n_ids:]
        self.finish = None
        self._buf = self.text = self._decode(self.ids)
        stream = getattr(self.tok, "stream", None)
        self._det = stream(0, skip_special_tokens=True) if callable(stream) else _FullDecode(self.tok)
        self._det.step(self.ids)
        self._sent = min(self._sent, len(self._buf))
