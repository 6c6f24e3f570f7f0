"""Padded shapes of prompt blocks (host only): the prompt-length buckets, the cache
size rounding, and how rows of different lengths are grouped into padded prefill blocks."""

from __future__ import annotations

# prompt lengths are padded to these (one prefill compilation each); steps of 1.5x above
# 128 tokens, where prefill is compute-bound and padding 278 tokens to 512 cost ~40%
PROMPT_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                  6144, 8192, 12288, 16384, 24576, 32768)
CACHE_ROUND = 256  # smallest cache; caches are powers of two so few shapes compile


def tail_bucket(block: int) -> int:
    """The narrower block a prompt's last piece of at most that many tokens is forwarded in,
    with chunked prefill in blocks of `block` tokens: the largest prompt bucket of at most
    half of it (64: 32; 16: none, 0). A 20-token last piece then costs a 32-token block,
    not a 64-token one (SmolLM2-135M on 2 CPU cores: ~0.05 s against ~0.09-0.11 s): a
    cached prompt's uncached tail, a short prompt, the end of every long one. One size
    only: each adds a program to compile (`programs.inventory`)."""
    return max((b for b in PROMPT_BUCKETS if 2 * b <= int(block)), default=0)


def prompt_bucket(n: int, S: int) -> int:
    """Padded length of a block of n tokens (at most the cache size S)."""
    P = next((b for b in PROMPT_BUCKETS if b >= n), -(-n // CACHE_ROUND) * CACHE_ROUND)
    return min(P, S)


# A block forward's fixed cost in token rows (its weights are read once, whatever the
# rows): rows of different lengths share one padded block only when the padding costs
# less than another forward. On the 2-core CPU a 1.5B model's forward of P tokens costs
# about (10 + P) x its per-token cost; accelerators amortize more, so this leans to merging.
BLOCK_OVERHEAD_TOKENS = 64


def prefill_groups(lengths: dict, S: int) -> list:
    """Rows {row: tokens to forward} -> groups of rows, each forwarded as one right-padded
    block, shortest first: the rows sorted by length are cut into consecutive groups
    minimizing sum(rows x prompt_bucket(longest) + BLOCK_OVERHEAD_TOKENS). Rows of one
    bucket always share a block (cutting between them only adds a forward), so the exact
    search runs over the distinct buckets, O(buckets^2) whatever the batch; ties keep fewer
    groups.
    # {0: 1504, 1: 20, 2: 18} -> [[2, 1], [0]]: 2 x 32 + 1536 + 2 x 64, not 3 x 1536 + 64
    """
    by_bucket: dict = {}
    for b in sorted(lengths, key=lambda b: (lengths[b], b)):
        by_bucket.setdefault(prompt_bucket(int(lengths[b]), S), []).append(b)
    buckets = sorted(by_bucket)
    n = len(buckets)
    rows_before = [0]
    for P in buckets:
        rows_before.append(rows_before[-1] + len(by_bucket[P]))
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + (rows_before[j] - rows_before[i]) * buckets[j - 1] + BLOCK_OVERHEAD_TOKENS
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append([b for P in buckets[cut[j]:j] for b in by_bucket[P]])
        j = cut[j]
    return groups[::-1]
