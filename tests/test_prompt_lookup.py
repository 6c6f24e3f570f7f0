"""bench/prompt_lookup.py: HF-style prompt lookup as a drafter of our engine is lossless."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lookahead_jax.generate import generate
from tiny import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from prompt_lookup import PromptLookupDrafter, lookup  # noqa: E402

MAX_NEW = 32
CACHE = 1280
TEXTS = [p["prompt"] for p in load_prompts(2)]  # 6 prompts from RAG / code / math


def test_lookup_takes_the_earliest_longest_ngram():
    #          0  1  2  3  4  5  6  7  8  9
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3]
    assert lookup(ctx, 2) == [9, 1]  # the 2-gram (2, 3): its earliest occurrence
    assert lookup(ctx + [5], 3) == []  # 5 never occurred before
    assert lookup([4, 1, 2, 3, 7, 0, 2, 3, 6, 1, 2, 3], 1) == [7]  # the 3-gram beats the later 2-gram
    assert lookup([7, 7], 10) == [7]  # the continuation may run into the match's own tail


@pytest.mark.parametrize("batch,k", [(1, 10), (3, 4)])
def test_prompt_lookup_equals_greedy(model, tok, batch, k):
    def run(**kw):
        ids, steps = [], 0
        for s in range(0, len(TEXTS), batch):
            out = generate(model, tok, TEXTS[s:s + batch], max_new_tokens=MAX_NEW, max_cache_len=CACHE, **kw)
            ids += out.token_ids
            steps += out.stats["forward_steps"]
        return ids, steps

    ref, plain_steps = run()
    ids, steps = run(strategy="lookahead", decoding_length=k, drafter=PromptLookupDrafter(k))
    assert ids == ref
    assert steps < plain_steps  # its drafts were accepted sometimes
