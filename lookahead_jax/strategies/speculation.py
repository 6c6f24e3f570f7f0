"""What the retrieval strategies (ralm / ralmspec, knnlm) share: option checks and the
stream that hands `on_text` only text no later retrieval can change."""

from __future__ import annotations

import numpy as np


def number_in(name, v, lo, hi, integer: bool = True) -> None:
    """A ValueError naming `name` unless v is an integer (or, integer=False, a number) in
    [lo, hi] (bools are not numbers here)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, np.integer) if integer else (int, float, np.number))
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} in [{lo}, {hi}], got {v!r}")


def auto_or_int(v):
    """"auto", or an integer from its string (the CLI's form); anything else as it is, for
    `validate` to name."""
    if isinstance(v, str) and v != "auto":
        try:
            return int(v)
        except ValueError:
            return v
    return v


class FinalTextStream:
    """Hands on_text only text that is final: the rows' own streaming is switched off and
    each flush sends the text of the tokens no retrieval can change (all of it once the row
    has finished), holding back a tail that is half a character or could grow into a stop
    string."""

    def __init__(self, state, tokenizer):
        self.tok = tokenizer
        self.on_text = {}
        self.sent = {}
        for r in state.rows:
            if r.on_text is not None:
                self.sent[r.index] = r.streamed_text
                self.on_text[r.index] = r.detach_stream()

    def flush(self, state, final_upto) -> None:
        for b, cb in self.on_text.items():
            r = state.rows[b]
            n = final_upto(state, b)
            done = r.finish is not None and n == len(r.ids)
            if done:
                text = r.text
            else:
                text = self.tok.decode(r.ids[:n], skip_special_tokens=True)
                end = len(text)
                while end and text[end - 1] == "\ufffd":
                    end -= 1
                for s in r.stop:
                    for k in range(min(len(s) - 1, end), 0, -1):
                        if text[end - k:end] == s[:k]:
                            end -= k
                            break
                text = text[:end]
            sent = self.sent[b]
            if len(text) > len(sent) and text.startswith(sent):
                cb(b, text[len(sent):])
                self.sent[b] = text
