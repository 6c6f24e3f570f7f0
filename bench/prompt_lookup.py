"""Prompt lookup decoding in our engine: HF transformers' `prompt_lookup_num_tokens` drafter.

`PromptLookupDrafter` proposes, per row and step, one chain of at most K tokens (default 10,
HF's usual `prompt_lookup_num_tokens`): the last n tokens of the context (prompt +
generated ids), n = `max_ngram` (3) down to 1, are searched in the context, and at the
first (earliest) occurrence that has tokens after it the next K tokens are the draft, as
HF's `PromptLookupCandidateGenerator` does (its `max_matching_ngram_size` defaults to 2
there; the original prompt-lookup code and this bench use 3). References are not searched
(HF's has none: in the RAG sets the passage is in the prompt). Unlike HF, a draft is not
cut at EOS (harmless: verification stops at EOS either way).

Used by bench/lookahead.py as `promptlookup[:K]` with decoding_length K; verified by our
engine like every drafter, so its tokens are greedy's (tests/test_prompt_lookup.py).
"""

from __future__ import annotations

import numpy as np

from lookahead_jax.core.drafts import EMPTY, Draft
from lookahead_jax.drafters.base import PerRowDrafter


def lookup(context, k: int, max_ngram: int = 3) -> list:
    """The next `k` tokens after the earliest earlier occurrence of the context's last n
    tokens (n = max_ngram .. 1, the longest with a continuation), or []."""
    x = np.asarray(context, np.int64)
    L = len(x)
    for n in range(min(max_ngram, L - 1), 0, -1):
        m = L - n  # windows starting at 0 .. L - n - 1 have a token after them
        hit = np.ones(m, bool)
        for j in range(n):
            hit &= x[j:j + m] == x[L - n + j]
        idx = np.flatnonzero(hit)
        if len(idx):
            s = int(idx[0]) + n
            return x[s:s + k].tolist()
    return []


class PromptLookupDrafter(PerRowDrafter):
    """Prompt lookup (module docstring): one chain of at most `k` tokens per row."""

    def __init__(self, k: int = 10, max_ngram: int = 3):
        self.k = k
        self.max_ngram = max_ngram
        self.max_nodes = k

    def propose_row(self, row: int, context: list, budget: int) -> Draft:
        toks = lookup(context, min(self.k, budget), self.max_ngram) if budget > 0 else []
        return Draft(toks, list(range(-1, len(toks) - 1))) if toks else EMPTY
