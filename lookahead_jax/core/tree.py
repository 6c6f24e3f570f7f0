"""Pack draft token trees into padded static arrays for the verifier (numpy, no jax).

A draft (``trie.Draft``) is a list of nodes in topological order: ``tokens[i]`` and
``parents[i]`` (index of the parent node, ROOT = -1 for a child of the root, the last
accepted token). ``pack`` pads a batch of drafts, one per row, to T nodes:

    tokens [B,T] int32   node tokens; PAD_TOKEN (0) where invalid
    parents[B,T] int32   parent index; ROOT (-1) for root children; PAD_PARENT (-2) padding
    depth  [B,T] int32   1 for root children (the root itself is depth 0); 0 for padding
    anc    [B,T,T] bool  anc[b,i,j] = node j is node i or one of its ancestors;
                         a padding row sees only itself, no valid row sees padding
    valid  [B,T] bool    node exists (padding is also ``parents == PAD_PARENT``)

Padding cannot be mistaken for a root child: its parent is PAD_PARENT, not ROOT.

Recurrences, in node order (a parent comes before its child):

    depth[i] = 1 if parents[i] == ROOT else depth[parents[i]] + 1
    anc[i]   = {i}  |  (anc[parents[i]] if parents[i] != ROOT else {})

    # parents: [-1, 0, 0, 1] -> depth: [1, 2, 2, 3]
    #   anc = [[1, 0, 0, 0],     node 0: itself
    #          [1, 1, 0, 0],     node 1: 0, itself
    #          [1, 0, 1, 0],     node 2: 0, itself
    #          [1, 1, 0, 1]]     node 3: 0, 1, itself

Verify block
------------
The verifier forwards the root (the last accepted token) followed by the T nodes, i.e.
1+T query tokens; block index 0 is the root and node i is block index i+1:

    tokens    [B,1+T] = [root, tokens]
    positions [B,1+T] = cache length + [0, depth]
    mask      [B,1+T,1+T] = verify_block_mask(anc):
                  row 0 (root)  [1, 0, ..., 0]
                  rows 1..T     [1 | anc]       (every row sees the root)

    # anc above ->  [[1, 0, 0, 0, 0],
    #                [1, 1, 0, 0, 0],
    #                [1, 1, 1, 0, 0],
    #                [1, 1, 0, 1, 0],
    #                [1, 1, 1, 0, 1]]

``with_root(packed, root_tokens)`` builds all of these (and parents in block indices).
The caller joins ``mask`` with the cached prefix (all cached slots visible to every row).

Static sizes: T is chosen from a few buckets (``bucket_for``) so the number of compiled
shapes stays small. The buckets make the verify block 1+T a power of two (T = 0, 1, 3, 7,
15, ...): XLA:CPU's dot is markedly cheaper when its row count is a multiple of 8. Measured
for the SmolLM2-135M verify step here: T=7 48 ms vs T=8 51 ms, T=15 56 ms vs T=16 62 ms.
A fixed budget d (``buckets_up_to``) adds d itself, so the tree is never padded past it.
A draft longer than T is an error unless ``truncate=True``, which keeps its first T nodes;
a prefix of a topological order is closed under parents, so the kept nodes still form a
tree (for a best-first hierarchical draft, the T best nodes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .drafts import Draft

ROOT = -1  # parent of a child of the root
PAD_PARENT = -2  # parent of a padding node
PAD_TOKEN = 0  # token of a padding node
BUCKETS = (0, 1, 3, 7, 15, 31, 63, 127)  # 1+T = 1, 2, 4, ..., 128 query rows
MAX_NODES = 128  # the largest draft budget


def buckets_up_to(limit: int) -> tuple:
    """Tree sizes a step may use under a budget of `limit` nodes: BUCKETS below it, and itself.

    # buckets_up_to(8) -> (0, 1, 3, 7, 8); buckets_up_to(7) -> (0, 1, 3, 7)
    """
    if not 0 <= limit <= MAX_NODES:
        raise ValueError(f"a draft budget must be in [0, {MAX_NODES}], got {limit}")
    return tuple(sorted({b for b in BUCKETS if b < limit} | {limit}))


@dataclasses.dataclass(frozen=True)
class PackedTree:
    """A batch of drafts padded to T nodes (module docstring)."""

    tokens: np.ndarray  # [B,T] int32
    parents: np.ndarray  # [B,T] int32
    depth: np.ndarray  # [B,T] int32
    anc: np.ndarray  # [B,T,T] bool
    valid: np.ndarray  # [B,T] bool

    @property
    def num_nodes(self) -> np.ndarray:
        """[B] int32: valid nodes per row."""
        return self.valid.sum(axis=-1, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class VerifyBlock:
    """Root + T nodes as one block of 1+T query tokens (index 0 = root, i+1 = node i)."""

    tokens: np.ndarray  # [B,1+T] int32: root token, then node tokens
    depth: np.ndarray  # [B,1+T] int32: position offsets (root 0)
    parents: np.ndarray  # [B,1+T] int32: block index of parent; -1 for the root,
    #                                      PAD_PARENT for padding
    valid: np.ndarray  # [B,1+T] bool: root always valid
    mask: np.ndarray  # [B,1+T,1+T] bool: verify_block_mask(anc)


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """Smallest bucket >= n.

    # bucket_for(0) -> 0, bucket_for(2) -> 3, bucket_for(63) -> 63, bucket_for(64) -> 127
    """
    if n < 0:
        raise ValueError(f"bucket_for: n must be >= 0, got {n}")
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"bucket_for: {n} nodes exceed the largest bucket {max(buckets)}")


def pack(drafts: Sequence[Draft], T: int, *, truncate: bool = False) -> PackedTree:
    """Pad one draft per row to T nodes.

    Raises ValueError for a draft longer than T (unless ``truncate``: keep its first T
    nodes), for mismatched lengths, and for parents that are not topological.
    """
    if T < 0:
        raise ValueError(f"T must be >= 0, got {T}")
    B = len(drafts)
    tokens = np.full((B, T), PAD_TOKEN, np.int32)
    parents = np.full((B, T), PAD_PARENT, np.int32)
    for b, d in enumerate(drafts):
        n = len(d.tokens)
        if len(d.parents) != n:
            raise ValueError(f"draft {b}: {n} tokens but {len(d.parents)} parents")
        if n > T:
            if not truncate:
                raise ValueError(
                    f"draft {b} has {n} nodes > T={T}; cap decoding_length or pass "
                    f"truncate=True"
                )
            n = T
        for i in range(n):
            if not ROOT <= d.parents[i] < i:
                raise ValueError(
                    f"draft {b}: parents[{i}] = {d.parents[i]} is not in [-1, {i}) "
                    f"(parents must come first)"
                )
        tokens[b, :n] = d.tokens[:n]
        parents[b, :n] = d.parents[:n]

    valid = parents != PAD_PARENT  # [B,T]
    depth = np.zeros((B, T), np.int32)
    anc = np.zeros((B, T, T), bool)
    rows = np.arange(B)
    for i in range(T):  # nodes in order: every parent row is final before its children
        p = parents[:, i]  # [B]
        has = p >= 0
        r, pr = rows[has], p[has]
        anc[r, i, :i] = anc[r, pr, :i]  # a parent's ancestors all lie before node i
        depth[r, i] = depth[r, pr] + 1
        depth[p == ROOT, i] = 1
        anc[:, i, i] = True
    return PackedTree(tokens=tokens, parents=parents, depth=depth, anc=anc, valid=valid)


def verify_block_mask(anc: np.ndarray) -> np.ndarray:
    """[..., T, T] ancestor mask -> [..., 1+T, 1+T] mask of the root + nodes block.

    Row 0 (root) sees only itself; every node row sees the root and its ``anc`` row.
    """
    *lead, T, T2 = anc.shape
    if T != T2:
        raise ValueError(f"anc must be square in its last two axes, got {anc.shape}")
    mask = np.zeros((*lead, 1 + T, 1 + T), bool)
    mask[..., :, 0] = True
    mask[..., 1:, 1:] = anc
    return mask


def with_root(packed: PackedTree, root_tokens: Sequence[int] | np.ndarray) -> VerifyBlock:
    """Prepend the root (last accepted token of each row, [B]) to the packed tree.

    # parents [-1, 0, -2] (2 nodes + padding) -> block parents [-1, 0, 1, -2]
    # depth   [ 1, 2,  0]                     -> block depth   [ 0, 1, 2, 0]
    """
    root = np.asarray(root_tokens, np.int32).reshape(-1)  # [B]
    B = packed.tokens.shape[0]
    if root.shape[0] != B:
        raise ValueError(f"root_tokens has {root.shape[0]} rows, the tree has {B}")
    col = lambda x: np.asarray(x, np.int32).reshape(B, 1)  # noqa: E731
    parents = np.where(packed.valid, packed.parents + 1, PAD_PARENT).astype(np.int32)
    return VerifyBlock(
        tokens=np.concatenate([col(root), packed.tokens], axis=1),
        depth=np.concatenate([col(np.zeros(B)), packed.depth], axis=1),
        parents=np.concatenate([col(np.full(B, -1)), parents], axis=1),
        valid=np.concatenate([np.ones((B, 1), bool), packed.valid], axis=1),
        mask=verify_block_mask(packed.anc),
    )


def verify_block(root, drafts, T: int) -> VerifyBlock:
    """Root [B] + drafts (one `Draft` per row) packed into the static [B,1+T] block the
    verify step takes."""
    return with_root(pack(drafts, T), root)
