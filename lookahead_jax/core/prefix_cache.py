"""A prefix cache: the K/V of prompt blocks a request prefilled, reused by later requests
whose prompts begin with the same tokens (repeated passages, system prompts, few-shot
headers), so that only the rest of their prompt is forwarded.

What a block is follows from chunked prefill (`Slots(prefill_chunk=C)`): a prompt is
forwarded in blocks of C tokens, each (but the last) committing its first U = C - 1 and
leaving its last as the root, which the next block forwards again. So block i of every
prompt forwards positions i*U .. i*U + C - 1 and commits slots [i*U, (i+1)*U), in one
program (one row of the chunk's padded width, the window a function of i alone), and
those slots' K/V depend only on tokens [0, (i+1)*U) (causal attention: the root forwarded
with them does not reach them). A block another request computed from the same tokens is
therefore the very K/V a fresh prefill would write, bit for bit (tests/test_prefix_cache.py
compares them), and a request that takes h cached blocks is, after writing them, in the
state its own prefill reaches after h blocks: its remaining blocks, first token and
everything after are those it gives without the cache.

    U=3 (C=4), prompt of L=9 tokens t0..t8: blocks [t0 t1 t2 t3] [t3 t4 t5 t6] [t6 t7 t8]
    cached units: slots 0-2 (key: t0..t2), 3-5 (key: t0..t5); the last block is never one

`PrefixCache` is the index (host only: no jax; the values are opaque to it): unit i of a prompt is keyed by a chain digest of
tokens [0, (i+1)*U) (vLLM's automatic prefix caching: a block's hash covers every token up
to it; here blake2b of the parent's digest and the block's ids, salted with what decides
the block's program: batch rows, cache slots, chunk width, the block's static mode), the
value is the unit's K/V (L x [K, U, H] for k and v, device arrays: `kv_blocks.copy_out`),
bounded in bytes with least-recently-used eviction (a hit or a store touches a prompt's
chain head last, so a prefix's tail goes before its head). One per engine
(`engine.stores.of(PrefixCache)`): it outlives the `Slots` that fill it (a server rebuilds
its slots for some requests) and every slot of the engine shares it. The engine's params
are bound to it: other params (a new checkpoint in the same model object) empty it.

`prefix_rows.PrefixRows` is the slots' side: at insert, each prompt's longest run of cached units (at
most its blocks but the last: a real forward always gives the first token's logits) is
written into its row and the row's length set past them (`fill`); after each non-last
prefill block, the unit it committed is copied out and stored (`save`), so a request
arriving while an earlier one with the same passage still decodes already hits.

`generate(prefix_cache=)` prefills through Slots with prefill_chunk and this cache (its rows
that share a header wait for its blocks: `PrefixRows.ready`). A retrieval run's slots
(RaLM, RaLMSpec, KNN-LM) use it too: they forward a whole prompt in pieces of the block
size, the same programs (`decode.forward_rows`), so its units are those above, and a
re-prefill after a passage change starts at a unit boundary and takes the new context's
cached units (`PrefixRows.take`).

A chat's answer enters the cache through a warm job (`prefix_warm.PrefixWarm`, queued by
the server when a chat request ends): the next turn's prompt as the chat template renders
it up to the end of the answer is forwarded in the same non-last blocks into a free slot,
each unit stored, no token emitted. Its units are computed by the very programs a prompt's
own prefill runs (never copied from decode-time K/V, which other programs computed), so
they too are bit for bit what the next turn's prefill would write.

SpecInfer's draft model keeps its own prompt units in a cache of this kind on its
engine (`drafters.draft_prefix`), forwarding a new request's context in the same blocks.

Not covered yet: prompts forwarded whole (Slots without prefill_chunk), and requests that
score their prompt (prompt_logprobs: each prompt token's log-probability needs its
forward; they neither take nor give blocks).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


def chain_keys(tokens: Sequence[int], unit: int, n: int, salt: bytes) -> list:
    """The digests of units 0..n-1 of `tokens` (unit i: tokens [0, (i+1)*unit)), each the
    hash of its parent's digest and its own ids: [k0, k1, ...], k_i = H(k_{i-1} | ids_i)."""
    ids = np.asarray(tokens[:n * unit], np.int32)
    out, h = [], hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(n):
        h = hashlib.blake2b(h + ids[i * unit:(i + 1) * unit].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


class PrefixCache:
    """Cached prefix units (module docstring): digest -> (k, v), least recently used first,
    at most `capacity` bytes. Counters (`summary`), shaped as vLLM's: `queries` prompt
    tokens looked up, `hits` tokens served from the cache (hit rate = hits / queries),
    `hit_blocks`, `lookups` / `hit_requests` (requests looked up / that hit), `stored`
    blocks, `evictions`, and `bytes` / `blocks` held now; warm jobs (`prefix_warm`):
    `warm_jobs` begun, `warm_tokens` they stored (units x unit tokens), `warm_cancelled`
    (cut short: a request needed the slot, or the slots were rebuilt)."""

    def __init__(self, capacity: int = 0):
        self.capacity = int(capacity)
        self._blocks: collections.OrderedDict = collections.OrderedDict()  # digest -> (kv, bytes)
        self.bytes = 0
        self.queries = self.hits = self.hit_blocks = self.lookups = self.hit_requests = 0
        self.stored = self.evictions = 0
        self.warm_jobs = self.warm_tokens = self.warm_cancelled = 0
        self._bound = None  # the params the blocks were computed with (`bind`)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key) -> bool:
        return key in self._blocks

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` bytes from now on (least recently used blocks go)."""
        self.capacity = int(capacity)
        self._evict(0)

    def bind(self, params) -> None:
        """The blocks are valid for `params` (compared by identity; `Engine.params` stays
        the same object while the model's params do): other params empty the cache."""
        if params is not self._bound:
            self.clear()
            self._bound = params

    def clear(self) -> None:
        """Forget every block (the counters stay)."""
        self._blocks.clear()
        self.bytes = 0

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's chain used, its head last (most recent): the tail is evicted first."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def match(self, keys: Sequence[bytes], tokens: int, unit: int, start: int = 0, again: bool = False,
              hit_before: bool = False, count: bool = True) -> list:
        """The cached blocks of the longest leading run of `keys` (units of `unit` tokens of
        a prompt of `tokens` tokens, all counted as queried), touched; [] on a miss.
        start: the units the prompt's row holds already (from here or its own blocks): the
        run from unit `start` (keys[:start] are touched too). again: a later look-up of a
        request looked up before (its hits count, its lookup and tokens do not again);
        hit_before: the request has counted as a hit already. count=False: a warm
        job's lookup (`prefix_warm`), in no counter."""
        hit = []
        for key in keys[start:]:
            entry = self._blocks.get(key)
            if entry is None:
                break
            hit.append(entry[0])
        self.touch(keys[:start + len(hit)])
        if not count:
            return hit
        if not again:
            self.lookups += 1
            self.queries += int(tokens)
        self.hit_requests += bool(hit) and not hit_before
        self.hit_blocks += len(hit)
        self.hits += len(hit) * int(unit)
        return hit

    def put(self, keys: Sequence[bytes], kv, nbytes: int) -> bool:
        """Store `kv` as the block of keys[-1] (keys: its chain from the prompt's first
        unit), evicting least recently used blocks to fit but never its own chain (a block
        whose parent is gone is never reached); False (nothing stored) when it is held
        already, its parent is not, or it does not fit beside its chain."""
        key = keys[-1]
        self.touch(keys)
        if key in self._blocks or (len(keys) > 1 and keys[-2] not in self._blocks) \
                or not self._evict(int(nbytes), keep=set(keys)):
            return False
        self._blocks[key] = (kv, int(nbytes))
        self.bytes += int(nbytes)
        self.stored += 1
        self.touch(keys)
        return True

    def _evict(self, room: int, keep=frozenset()) -> bool:
        """Evict least recently used blocks (none in `keep`) until `room` more bytes fit;
        whether they do."""
        while self.bytes + room > self.capacity:
            key = next(iter(self._blocks), None)
            if key is None or key in keep:  # (a chain just touched is the most recent: nothing else is left)
                return False
            _, nbytes = self._blocks.pop(key)
            self.bytes -= nbytes
            self.evictions += 1
        return True

    def summary(self) -> dict:
        return dict(prefix_cache_queries=self.queries, prefix_cache_hits=self.hits,
                    prefix_cache_hit_blocks=self.hit_blocks, prefix_cache_lookups=self.lookups,
                    prefix_cache_hit_requests=self.hit_requests, prefix_cache_stored=self.stored,
                    prefix_cache_evictions=self.evictions, prefix_cache_bytes=self.bytes,
                    prefix_cache_blocks=len(self._blocks), prefix_cache_capacity=self.capacity,
                    prefix_cache_warm_jobs=self.warm_jobs, prefix_cache_warm_tokens=self.warm_tokens,
                    prefix_cache_warm_cancelled=self.warm_cancelled)


def budget_bytes(value) -> int:
    """A `prefix_cache=` option as bytes: None / 0 / False: off (0); a positive int."""
    if value is None or value is False or value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"prefix_cache must be a byte budget (an integer >= 0; 0 or None: off), got {value!r}")
    return int(value)

