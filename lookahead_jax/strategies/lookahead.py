"""Lookahead: drafts from the request's own tokens (prompt, references, output so far) and
earlier outputs, verified as one token tree per step; the same tokens as greedy. The
drafter is the adaptive suffix drafter (`drafters/suffix.py`, the default) or the n-gram
trie (`drafters/trie.py`, `drafts="trie"`)."""

from __future__ import annotations

import dataclasses
import time

from ..core import tree as tree_lib
from ..core.acceptance import TokenMatch
from ..core.budget import AcceptanceStats, AutoBudget, FixedBudget, StepTimes, prior_costs
from .base import StrategyBase


# the suffix drafter's settings under Lookahead (drafts="suffix", the default): a tree of at most
# match length + 2 nodes, filled up to its tree bucket (the best estimated speedup of the
# offline replay, bench/results/suffix-replay.json: "alpha 1, offset 2, cost-trimmed"; sized
# by auto's budget, suffix-replay-auto.json: est. 1.95x on NQ RAG vs the trie's 1.81x)
SUFFIX_SETTINGS = dict(alpha=1.0, offset=2.0, buckets=tree_lib.BUCKETS)


@dataclasses.dataclass(frozen=True)
class Lookahead(StrategyBase):
    """Drafts from the request's prompt, references and output so far and from earlier
    outputs, verified as one token tree per step; output identical to Greedy.

    decoding_length: draft nodes per step (0..128), or "auto": the budget that maximises
        expected tokens/s from verify costs among tree sizes T = 0, 1, 3, 7, 15, 31, 63
        (verify blocks of 1+T = 2^k tokens). Tuned on CPU; on a GPU a fixed 15 is faster
        for now.
    drafts: "suffix" (the default: the adaptive suffix drafter of `drafters/suffix.py`,
        longest suffix match over the request and a bounded cache of earlier outputs in this
        process, at `SUFFIX_SETTINGS`; at most 32 nodes a step under "auto", decoding_length
        nodes when fixed) or "trie" (the n-gram trie
        of `drafters/trie.py` over the request's n-grams and every earlier output's). With
        "auto" the trees are sized by their nodes' calibrated acceptance against the verify
        costs (`core/budget.py`).
    branch_length: maximum draft depth.  mode: hierarchical | parallel | single (the
        trie's; unused with drafts="suffix").
    calibrate: with "auto", time every tree size before the first request of a shape
        (~20-30 s on a 2-core CPU, compiling every size) instead of starting from the
        platform's typical costs for the batch's size (`budget.prior_costs`: a tree in a
        full batch costs more, so `auto` drafts less as slots fill). Either way the times of
        real steps correct the costs as decoding goes, and a tree size compiles when
        first used."""

    decoding_length: object = "auto"
    branch_length: int = 12
    mode: str = "hierarchical"
    calibrate: bool = False
    drafts: str = "suffix"

    name = "lookahead"
    help = "suffix-match drafts (or --drafts trie: n-gram trie) verified as a token tree (same tokens as greedy)"
    cli_names = {"mode": "lookahead-mode"}
    choices = {"mode": ("hierarchical", "parallel", "single"), "drafts": ("suffix", "trie")}
    field_help = {
        "branch_length": "with --drafts trie: maximum draft depth (default 12)",
        "mode": "with --drafts trie: how the trie's drafts branch (default hierarchical)",
        "calibrate": "true: with --decoding-length auto, time every tree size before decoding (~20-30 s "
                     "on a 2-core CPU) instead of starting from typical costs that real steps correct "
                     "(default false)",
        "drafts": "suffix (default): the adaptive suffix drafter (longest suffix match over the request "
                  "and a cache of earlier outputs); trie: the n-gram trie",
    }

    takes_references = True

    @property
    def auto(self) -> bool:
        return self.decoding_length == "auto"

    def unused_options(self, greedy: bool) -> dict:
        """{field: why} for fields this configuration does not use (the CLI warns when given)."""
        out = {} if self.auto else {"calibrate": "with a fixed --decoding-length (it times auto's tree sizes)"}
        if self.drafts == "suffix":
            out.update(branch_length="with --drafts suffix", mode="with --drafts suffix")
        return out

    def validate(self) -> None:
        dl = self.decoding_length
        if not self.auto and (not isinstance(dl, int) or isinstance(dl, bool)
                              or not 0 <= dl <= tree_lib.MAX_NODES):
            raise ValueError(f"decoding_length must be 'auto' or an integer in [0, {tree_lib.MAX_NODES}], got {dl!r}")
        if self.drafts not in self.choices["drafts"]:
            raise ValueError(f"drafts must be one of {self.choices['drafts']}, got {self.drafts!r}")
        # the trie's options are checked whichever drafter runs: a bad value is an error, not ignored
        if self.mode not in self.choices["mode"]:
            raise ValueError(f"lookahead mode must be one of {self.choices['mode']}, got {self.mode!r}")
        bl = self.branch_length
        if not isinstance(bl, int) or isinstance(bl, bool) or not 1 <= bl <= 64:
            raise ValueError(f"branch_length must be in [1, 64], got {bl!r}")

    def drafter(self, engine):
        if self.drafts == "suffix":
            from ..drafters.suffix import SuffixDrafter, SuffixStore

            # its acceptance statistics outlive requests, as the trie's (one per settings)
            stats = engine.stores.of(SuffixStore).acceptance.setdefault(tuple(SUFFIX_SETTINGS.items()),
                                                                        AcceptanceStats())
            # a fixed decoding_length above its usual 32 nodes is the tree's cap instead
            nodes = 32 if self.auto else max(32, self.decoding_length)
            return SuffixDrafter.shared(engine, acceptance=stats, max_nodes=nodes, **SUFFIX_SETTINGS)
        from ..drafters.trie import TrieDrafter  # greedy needs no drafter

        return TrieDrafter.shared(engine, branch_length=self.branch_length, mode=self.mode)

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes if self.auto else self.decoding_length

    def setup(self, engine, state, drafter, references=None):
        rule = TokenMatch(state.sampling)
        if not self.auto:
            return drafter, rule, FixedBudget(self.decoding_length)
        buckets = tuple(b for b in tree_lib.BUCKETS if b <= drafter.max_nodes)
        B, S = state.batch, state.max_len
        t0 = time.perf_counter()
        if self.calibrate:  # every bucket timed once per shape, at a typical length of this run
            # a typical length of this run (before any row is in: half the cache)
            mid = int(state.lengths.max()) + state.rows[0].max_new // 2 if state.active.any() else None
            costs = engine.measure_verify_costs(rule, B, S, buckets, mid)
        else:
            costs = prior_costs(engine.platform, buckets, batch=B)
        times = engine.step_times.setdefault((rule, B, S), StepTimes())
        policy = AutoBudget(buckets, costs, getattr(drafter, "acceptance", None), times=times)
        policy.calibrate_s = time.perf_counter() - t0 if self.calibrate else 0.0
        return drafter, rule, policy
