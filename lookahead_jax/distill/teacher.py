"""The teacher: the target continues prompts greedily and keeps its top-k log-probabilities
at every position, through the engine's own steps (`Engine.extend` for the prompts,
`Engine.verify` with no drafts for each greedy step: plain decoding's executables and
packed weights), so its continuations are exactly `generate`'s."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..core.acceptance import TokenMatch
from ..core.decode import prompt_bucket
from ..core.drafts import DraftBatch
from ..core.engine import engine_for
from ..core.inputs import StepInputs, StepMode
from ..core.sampling import SamplingParams
from ..core.tree import verify_block
from ..core.verify import window_for


def teacher_chunk(model, prompt_ids: Sequence[Sequence[int]], gen_tokens: int, seq_len: int, k: int,
                  eos_ids=(), batch: Optional[int] = None) -> list:
    """The target (a model or its `Engine`) continues each prompt greedily (at most
    `gen_tokens`, to EOS) and keeps its top-k log-probs at every position. -> per prompt a
    dict with `tokens` (prompt + continuation, EOS included), `n_prompt`, `topk_v` [n-1,k]
    f16 and `topk_i` [n-1,k] int32: the target's distribution over token t+1 at position t.

    Rows are padded to `batch` (default: the prompt count) with one-token dummies so the
    steps see one shape; the cache holds `seq_len` slots."""
    engine = engine_for(model)
    n = len(prompt_ids)
    B = batch or n
    lens = [len(p) for p in prompt_ids]
    if B < n or min(lens) < 1:
        raise ValueError(f"teacher_chunk: {n} non-empty prompts need batch >= {n}, got {B}")
    if max(lens) + gen_tokens > seq_len:
        raise ValueError(f"a prompt of {max(lens)} tokens + {gen_tokens} new does not fit {seq_len}")
    P = prompt_bucket(max(lens), seq_len)  # few prompt shapes: few compilations
    toks = np.zeros((B, P), np.int32)
    for r, p in enumerate(prompt_ids):
        toks[r, :len(p)] = p
    lengths = np.array(lens + [1] * (B - n), np.int32)
    greedy = SamplingParams()
    seeds, rowids = engine.put(np.zeros(B, np.uint32)), engine.put(np.arange(B, dtype=np.int32))
    # the prompt forward from an empty cache (it reads only its own P slots); top-k after
    # every prompt token, the last one's the distribution the first new token comes from
    first, cache = engine.extend(engine.init_cache(B, seq_len), StepInputs(toks, seeds, rowids, n_new=lengths),
                                 StepMode(window=P, top_logprobs=k))
    nxt, v, i = first.tokens, np.asarray(first.top_logprobs), np.asarray(first.top_ids)
    vs = [[v[r, :lens[r]]] for r in range(n)]  # positions 0..len-1 of the prompt
    is_ = [[i[r, :lens[r]]] for r in range(n)]
    gen: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    eos = set(int(e) for e in eos_ids)
    rule, no_drafts = TokenMatch(greedy), DraftBatch.empty(B).drafts
    for _ in range(gen_tokens):
        nxt = np.asarray(nxt)
        for r in range(n):
            if not done[r]:
                gen[r].append(int(nxt[r]))
                done[r] = int(nxt[r]) in eos or len(gen[r]) >= gen_tokens
        if all(done):
            break
        active = np.array([not d for d in done] + [False] * (B - n))
        window = window_for(int(lengths[active].max()) + 1, seq_len)
        out, cache = engine.verify(cache, StepInputs.tree(verify_block(nxt, no_drafts, 0), active, seeds, rowids),
                                   StepMode(window=window, top_logprobs=k), rule=rule)
        lengths = lengths + np.asarray(out.n)
        nxt = np.asarray(out.tokens)[:, 0]
        v, i = np.asarray(out.top_logprobs)[:, 0], np.asarray(out.top_ids)[:, 0]  # [B,k]: where each row's token was chosen
        for r in range(n):
            if not done[r]:
                vs[r].append(v[r][None])
                is_[r].append(i[r][None])
    out = []
    for r in range(n):
        tokens = list(prompt_ids[r]) + gen[r]
        tv = np.concatenate(vs[r])[:len(tokens) - 1].astype(np.float16)
        ti = np.concatenate(is_[r])[:len(tokens) - 1].astype(np.int32)
        out.append(dict(tokens=np.asarray(tokens, np.int32), n_prompt=lens[r], topk_v=tv, topk_i=ti))
    return out
