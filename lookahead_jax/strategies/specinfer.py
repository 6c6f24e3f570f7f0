"""SpecInfer: a small draft model grows a token tree on device (`drafters/model.py`),
optionally merged with the n-gram trie's; the target verifies it in one forward. Also the
draft-model plumbing: loading a draft once per target engine, checking its vocabulary."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import numpy as np

from ..core import tree as tree_lib
from ..core.acceptance import SpecSampling, TokenMatch
from ..core.budget import FixedBudget, StepTimes, prior_costs
from ..core.multihost import agree_choice, multiprocess
from ..core.tree import buckets_up_to
from ..drafters.model import SAMPLERS
from .base import StrategyBase

DRAFT_WEIGHTS = ("bfloat16", "float32")  # storage of a draft model's packed CPU weights

log = logging.getLogger("lookahead_jax")


def _expansion(value) -> tuple:
    """--expansion "1,1,3,1" -> (1, 1, 3, 1)"""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class SpecInfer(StrategyBase):
    """A small draft model proposes a token tree (SpecInfer's expansion-based trees, grown
    on device over the draft's own KV cache, `drafters/model.py`); the target verifies it
    in one forward. Greedy: output identical to Greedy. Sampling: `sampler="mss"` keeps the
    output distribution exactly the target's (multi-step speculative sampling over
    children drawn without replacement, `acceptance.SpecSampling`); `sampler="invariant"`
    draws the draft with the target's position-keyed noise and gives plain sampling's
    tokens for the same seed.

    draft_model: a preset name, a local path (e.g. a `python -m lookahead_jax.distill`
        output), or a loaded `Model`; same tokenizer as the target.
    expansion: children per node at each depth; default (1, 1, 1, 1), a chain of 4 (fastest
        measured on CPU); SpecInfer's paper tree (1, 1, 3, 1, 1, 1, 1, 1) = 20 nodes.
    lookahead_nodes: > 0 merges that many nodes of the n-gram trie (lookahead's
        drafts="trie": prompt, past outputs) into the draft model's tree each step
        (`drafters/merge.py`); greedy or sampler="invariant" only.
    draft_weights: "bfloat16" (default) stores the draft's packed CPU weights in bf16 and
        computes in f32: its forwards, which dominate a step on CPU, read half the bytes.
        The draft only proposes, so the output is unchanged (greedy: the target's tokens;
        sampling: the target's distribution); acceptance may move slightly. "float32": the
        draft exactly as loaded. Where the CPU kernels do not run (GPU/TPU, a mesh) the
        draft runs as loaded: load it in bf16 there.
    budget: "auto" (default): a step drafts only where the tokens a drafted step gains pay
        for its cost in plain steps of this batch (`DraftBudget`: the verify block's prior
        cost for B rows, the draft's measured cost, the measured gain); "fixed": every step
        drafts the tree. Qwen2.5-Coder 0.5B -> 1.5B through the server, 2-core CPU, 48
        tokens, per slot count (1 / 4 / 8 concurrent requests): auto 1.39x / 0.98x / 0.98x
        greedy, fixed 1.40x / 0.90x / 0.73x (a fuller verify block is compute-bound, so
        auto decodes plainly in full batches)."""

    draft_model: object = None
    expansion: tuple = (1, 1, 1, 1)
    sampler: str = "mss"
    lookahead_nodes: int = 0
    draft_weights: str = "bfloat16"
    budget: str = "auto"

    name = "specinfer"
    help = "a draft model's token tree verified in one forward (greedy: same tokens; sampling: same distribution)"
    choices = {"sampler": SAMPLERS, "draft_weights": DRAFT_WEIGHTS, "budget": ("auto", "fixed")}
    # budget is "auto" or "fixed": a str (not the auto-or-integer flag of other fields defaulting to "auto")
    parsers = {"expansion": _expansion, "draft_model": str, "budget": str}
    metavars = {"draft_model": "NAME_OR_PATH", "expansion": "W1,W2,..."}
    field_help = {
        "draft_model": "the draft model: a preset (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b) or "
                       "a local path (e.g. a python -m lookahead_jax.distill output); same tokenizer as --model",
        "expansion": "children per node at each depth of the draft tree (default 1,1,1,1: a chain of 4; SpecInfer's tree: 1,1,3,1,1,1,1,1)",
        "lookahead_nodes": "merge this many n-gram trie nodes (lookahead's --drafts trie) into the draft model's "
                           "tree (default 0: none; greedy or --sampler invariant)",
        "sampler": "with --temperature > 0: mss = exact speculative sampling (the target's distribution); "
                   "invariant = the draft uses the target's random keys (the tokens of plain sampling "
                   "with the same --seed)",
        "draft_weights": "storage of the draft's weights on CPU: bfloat16 (default; half the bytes per draft "
                         "forward, f32 arithmetic, same output) or float32",
        "budget": "auto (default): a step drafts only where its measured gain pays for the draft and the "
                  "tree at this batch size (plain decoding in full batches); fixed: every step drafts",
    }

    def __post_init__(self):
        if isinstance(self.expansion, (str, list)):
            object.__setattr__(self, "expansion", _expansion(self.expansion))

    @property
    def takes_references(self) -> bool:  # they seed the merged n-gram trie
        return bool(self.lookahead_nodes)

    def unused_options(self, greedy: bool) -> dict:
        """{field: why} for fields this configuration does not use (the CLI warns when given)."""
        return {"sampler": "at --temperature 0 (greedy verification)"} if greedy else {}

    def validate(self) -> None:
        from ..drafters.model import check_expansion

        if self.draft_model is None or self.draft_model == "":
            raise ValueError("strategy 'specinfer' needs a draft model: draft_model=NAME_OR_PATH "
                             "(CLI: --draft-model), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be 'bfloat16' or 'float32', got {self.draft_weights!r}")
        if self.budget not in ("auto", "fixed"):
            raise ValueError(f"budget must be 'auto' or 'fixed', got {self.budget!r}")
        from ..drafters.model import expansion_tree

        n = len(expansion_tree(check_expansion(self.expansion, tree_lib.MAX_NODES))[0])
        if not isinstance(self.lookahead_nodes, int) or not 0 <= self.lookahead_nodes <= tree_lib.MAX_NODES - n:
            raise ValueError(f"lookahead_nodes must be an integer in [0, {tree_lib.MAX_NODES - n}] (the "
                             f"expansion's tree has {n} nodes, a step verifies at most {tree_lib.MAX_NODES}), "
                             f"got {self.lookahead_nodes!r}")

    def check_target(self, target) -> None:
        """Before anything loads: ValueError when the draft's vocabulary and the target's
        (`target`: a name or path as `load` takes), both read without their weights
        (`loading.vocab_size`), are known and differ, or when the draft's name is no model.
        `check_draft` checks loaded models."""
        from ..loading import vocab_size

        if not isinstance(self.draft_model, str) or not isinstance(target, str):
            return
        try:
            dv = vocab_size(self.draft_model)
        except ValueError as e:
            raise ValueError(f"cannot load draft model {self.draft_model!r}: {e}") from e
        tv = vocab_size(target)
        if dv and tv and dv != tv:
            raise ValueError(_vocab_mismatch(self.draft_model, dv, target, tv))

    def drafter(self, engine):
        from ..drafters.model import ModelDrafter

        model = ModelDrafter(draft_engine(engine, self.draft_model, self.draft_weights), self.expansion,
                             self.sampler)
        if not self.lookahead_nodes:
            return model
        from ..drafters.merge import MergedDrafter
        from ..drafters.trie import TrieDrafter

        return MergedDrafter(model, TrieDrafter.shared(engine, max_nodes=self.lookahead_nodes))

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes

    def setup(self, engine, state, drafter, references=None):
        if not state.sampling.greedy and self.sampler == "mss" and self.lookahead_nodes:
            raise ValueError("lookahead_nodes > 0 merges trees, which are verified by matching tokens: "
                             "use temperature 0 or sampler='invariant'")
        # SpecSampling takes each row's sampling (its greedy rows: TokenMatch), so sampled
        # requests may join greedy ones on Slots
        mss = self.sampler == "mss" and not self.lookahead_nodes
        rule = SpecSampling(state.sampling) if mss else TokenMatch(state.sampling)
        if self.budget != "auto":
            return drafter, rule, FixedBudget(drafter.max_nodes)
        B, S = state.batch, state.max_len
        T = DraftBudget.tree_size(drafter.max_nodes)
        prior = prior_costs(engine.platform, (T,), batch=B)[T]
        # its own (not lookahead's: its tree sizes and drafts differ, and each budget reads
        # the observed ratios of the T it verifies)
        times = engine.step_times.setdefault(("specinfer", rule, B, S), StepTimes())
        from ..drafters.model import ModelDrafter

        model = next(d for d in getattr(drafter, "drafters", (drafter,)) if isinstance(d, ModelDrafter))
        # what earlier batches of this engine measured (the draft's cost, the gains): a new
        # batch (a generate call, the server's slots rebuilt) starts from it, not from probes
        measures = engine.stores.of(DraftStore).budgets.setdefault((id(model.engine), rule, B, S, T), DraftMeasures())
        return drafter, rule, DraftBudget(drafter.max_nodes, prior, times, model, measures)


class DraftMeasures:
    """What a `DraftBudget` has measured, kept per engine, draft, rule and batch shape
    (`DraftStore.budgets`) so that the next batch of the same shape starts from it:
    delta (the draft's step in plain steps of the target, a moving average) and the
    extra tokens per row of the last drafted steps."""

    def __init__(self):
        self.delta = None
        self.gains = collections.deque(maxlen=64)


class DraftBudget:
    """SpecInfer's budget under `budget="auto"` (the default): each step drafts the whole tree
    (T nodes) or nothing, whichever is predicted to give more tokens per second. Every
    step computes all B rows of the batch, busy or not, so its cost does not depend on how
    many rows are active; in units of a plain step at this batch:
    - rho = t(T) / t(0), the target's verify block with the tree: the platform's prior for
      B x (1 + T) rows against B rows (`budget.prior_costs`), blended with the ratios
      observed on real steps (`budget.StepTimes`, shared per engine and batch shape);
    - delta = d / t(0), the draft model's step: measured on drafted steps as d x rho / v_T
      (d and v_T from the same step, so the host's drift cancels), a moving average;
    - a: the mean tokens a row gains per drafted step beyond the one plain decoding gives
      (the last 64 drafted steps, rows that kept their request).
    Draft iff 1 + a > (1 + MARGIN)(rho + delta): at 1 slot on a CPU a chain of 4 costs
    ~1.2 plain steps of the target, at 8 slots ~3 (a fuller block is compute-bound), so a
    server with many slots stops drafting unless its drafts are long. Until delta and a
    are measured it drafts. A plain choice holds HOLD steps, then one drafted step (a
    probe) measures a again (only a can change: the costs are the batch's); while probes
    keep choosing plain the hold doubles, up to MAX_HOLD. A probe after plain steps pays
    the draft's catch-up forward of what it missed (so does a new request's first drafted
    step: its prompt; the drafter's `catch_up_s` keeps it out of delta), so a probe (and
    every drafted step before the first measurements) drafts only the rows whose draft
    context lags by at most PROBE_LAG tokens, or the one that lags least
    (`ModelDrafter.probe_lag`): one row's catch-up, not every slot's prompt (~7 s at 8
    slots of Qwen2.5-Coder 0.5B), and its gain is read on the rows it drafted. It still
    verifies the whole block (~rho + delta - 1 plain steps: ~5 at 16 slots of Qwen2.5-Coder
    1.5B), so a hold is never shorter than that cost over PROBE_SHARE (probes <= 2% of the
    steps). delta and the gains outlive the batch (`DraftMeasures`): a new batch of the
    same shape starts from them instead of probing.
    A step's gain is read at the next step's `propose_nodes` (the state then holds what it
    accepted, also when decode.step defers `score` under overlap). Only which steps draft
    changes, never what a step accepts: the tokens are plain decoding's (greedy), the
    distribution the target's (sampling). Over several processes the choice (and whether it
    is a probe) is process 0's (`multihost.agree_choice`): the draft's programs run on every
    process, and each process's own timings would choose apart."""

    MARGIN, HOLD, MAX_HOLD, ALPHA, COST_PRIOR, PROBE_LAG, PROBE_SHARE = 0.03, 16, 1024, 0.3, 4.0, 64, 0.02
    calibrate_s = 0.0

    def __init__(self, limit: int, prior: float = None, times: StepTimes = None, drafter=None,
                 measures: DraftMeasures = None):
        self.buckets = buckets_up_to(limit)
        self.max_nodes = limit
        self.T = self.tree_size(limit)
        self.prior = prior_costs("cpu", (self.T,))[self.T] if prior is None else prior  # rho before observations
        self.times = times if times is not None else StepTimes()
        self.measures = measures if measures is not None else DraftMeasures()
        self.hold, self.next_hold = 0, self.HOLD
        self.probing = False  # this step's draft is a probe (set by choose)
        self.drafted = self.plain = 0
        self.gain_sum, self.gain_n = 0.0, 0  # this budget's own drafted steps (`gains` also holds earlier batches')
        self.drafter = drafter  # the ModelDrafter (its catch_up_s, probe_lag, drafted rows), if any
        self._step = None  # (drafted, {row: (its Row, tokens before)}, t0, compile_s0, catch_up0)
        self._draft_s = None  # the draft's seconds in this step (None: not a sample)

    @staticmethod
    def tree_size(limit: int) -> int:
        """T: the verify bucket a tree of `limit` nodes pads to."""
        return tree_lib.bucket_for(limit, buckets_up_to(limit))

    @property
    def delta(self):  # the draft's step / a plain step (moving average); None: not measured
        return self.measures.delta

    @delta.setter
    def delta(self, value):
        self.measures.delta = value

    @property
    def gains(self):  # extra tokens per row of the last drafted steps
        return self.measures.gains

    def catch_up(self) -> float:
        return 0.0 if self.drafter is None else self.drafter.catch_up_s

    def rho(self) -> float:
        return self.times.blended(self.T, self.prior, self.COST_PRIOR)

    def choose(self) -> bool:
        """Draft this step? (`probing`: whether that draft is a probe)"""
        self.probing = False
        if self.delta is None or not self.gains:
            self.probing = True
            return True
        if self.hold:
            self.hold -= 1
            self.probing = self.hold == 0
            return self.probing  # the last held step measures the drafts again
        a = sum(self.gains) / len(self.gains)
        if 1 + a > (1 + self.MARGIN) * (self.rho() + self.delta):
            self.next_hold = self.HOLD
            return True
        # a probe costs ~rho + delta - 1 plain steps (the whole block verifies its one row's
        # tree): hold long enough that probes stay under PROBE_SHARE of the steps
        floor = math.ceil((self.rho() + self.delta - 1) / self.PROBE_SHARE)
        self.hold = min(max(self.next_hold, floor), self.MAX_HOLD)
        self.next_hold = min(2 * self.next_hold, self.MAX_HOLD)
        return False

    def _close(self, state) -> None:
        """The last step's gain per row, now that the state holds what it accepted."""
        if self._step is None:
            return
        draft, before = self._step[:2]
        self._step = None
        rows = None  # the rows the step drafted for (a probe: not every active row)
        if draft and self.drafter is not None and len(self.drafter.drafted) == state.batch:
            rows = self.drafter.drafted
        gained = [len(state.rows[b].ids) - n for b, (row, n) in before.items()
                  if state.rows[b] is row and (rows is None or rows[b])]
        if draft and gained:
            self.gains.append(sum(gained) / len(gained) - 1)
            self.gain_sum += self.gains[-1]
            self.gain_n += 1

    def propose_nodes(self, state) -> int:
        self._close(state)
        active = np.flatnonzero(state.active)
        draft = self.choose()
        if multiprocess():  # the draft's programs span every process: process 0's choice, before they run
            draft, self.probing = (bool(v) for v in agree_choice(draft, self.probing))
        if self.drafter is not None:
            self.drafter.probe_lag = self.PROBE_LAG if draft and self.probing else None
        if draft:
            self.drafted += 1
        else:
            self.plain += 1
        self._step = (draft, {int(b): (state.rows[b], len(state.rows[b].ids)) for b in active},
                      time.perf_counter(), state.compile_s, self.catch_up())
        self._draft_s = None
        return self.max_nodes if draft else 0

    def plan(self, drafts, state) -> int:
        if self._step is not None and self._step[0]:  # the draft's time: compilation and catch-up left out
            _, _, t0, c0, u0 = self._step
            self._draft_s = time.perf_counter() - t0 - (state.compile_s - c0) - (self.catch_up() - u0)
        return self.max_nodes

    def record(self, T: int, window: int, seconds: float) -> None:
        self.times.record(T, window, seconds)
        if T and self._draft_s is not None and seconds > 0:
            x = self._draft_s * self.rho() / seconds
            self.delta = x if self.delta is None else self.delta + self.ALPHA * (x - self.delta)
        self._draft_s = None

    def score(self, state) -> None:
        pass  # read at the next propose_nodes (`_close`)

    def summary(self) -> dict:
        return {"draft_budget": dict(
            drafted_steps=self.drafted, plain_steps=self.plain,
            mean_tokens_per_drafted_step=round(1 + self.gain_sum / self.gain_n, 3) if self.gain_n else None,
            verify_cost_ratio=round(self.rho(), 3),
            draft_cost_ratio=None if self.delta is None else round(self.delta, 3))}


@dataclasses.dataclass
class DraftStore:
    """What SpecInfer keeps on the target's engine across requests
    (`engine.stores.of(DraftStore)`, made on first use, kept as long as the engine): the
    draft engines (`draft_engine`) and draft models loaded by name (`load_draft`), the
    drafts already warned about (`check_draft`), and the auto budget's measurements
    (`DraftMeasures`, per draft engine, rule and batch shape)."""

    engines: dict = dataclasses.field(default_factory=dict)  # (draft, weights, no mesh) -> Engine
    models: dict = dataclasses.field(default_factory=dict)  # preset / path -> Model
    size_warned: set = dataclasses.field(default_factory=set)  # ids of drafts warned about
    budgets: dict = dataclasses.field(default_factory=dict)  # (draft engine, rule, B, S, T) -> DraftMeasures


def draft_engine(engine, draft_model, weights: str = "bfloat16"):
    """The Engine that runs the draft for `engine`'s target (`load_draft`), made once per
    (target engine, draft, weights). weights="bfloat16" on one CPU device: a private Engine
    whose packed weights are bf16 (`Engine.weight_dtype`), so a draft Model the caller
    passed in keeps its exact self elsewhere; "float32", or on a mesh: the draft's shared
    engine (`engine_for`)."""
    from ..core.engine import Engine, engine_for

    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be 'bfloat16' or 'float32', got {weights!r}")
    by_name = isinstance(draft_model, str)
    engines = engine.stores.of(DraftStore).engines
    key = (draft_model if by_name else id(draft_model), weights, engine.mesh is None)
    hit = engines.get(key)
    if hit is not None and (by_name or _runs(hit, draft_model)):
        return hit
    if weights == "float32" or engine.mesh is not None:
        eng = engine_for(load_draft(engine, draft_model), engine.mesh)
    else:
        # by name: a copy of our own (not the shared float32 one) whose params are its bf16
        # packed weights (one copy in memory; packed into bf16 as each weight is read)
        draft = check_draft(engine, _load_by_name(engine, draft_model, packed_dtype="bfloat16") if by_name
                            else draft_model, draft_model)
        eng = Engine(draft)  # holds the draft: kept as long as the target's engine
        eng.weight_dtype = "bfloat16"
        if by_name:
            eng.keep_packed_only(consume=True)
    engines[key] = eng
    return eng


def _runs(engine, model) -> bool:
    """Whether `engine` (cached under id(model)) still runs `model`: an id can be reused
    after its model is gone, and `engine_for`'s engines hold their model weakly."""
    try:
        return engine.model is model
    except RuntimeError:  # its model was garbage-collected
        return False


def load_draft(engine, draft_model, pack: bool = True):
    """The draft model for `engine`'s target: loaded once per (engine, name) in the target's
    dtype, checked to share the target's vocabulary (an error otherwise), with a warning
    when it is not smaller than the target. A draft loaded by name is ours alone: with
    `pack` (one CPU device) its packed copy replaces its params (one copy in memory)."""
    if isinstance(draft_model, str):
        cache = engine.stores.of(DraftStore).models
        if draft_model not in cache:
            cache[draft_model] = _load_by_name(engine, draft_model)
        draft = cache[draft_model]
        if pack and engine.mesh is None:
            from ..core.engine import engine_for

            engine_for(draft).keep_packed_only()
    else:
        draft = draft_model
    return check_draft(engine, draft, draft_model)


def _load_by_name(engine, name: str, packed_dtype=None):
    from ..loading import load

    try:
        return load(name, dtype=engine.dtype, packed_dtype=packed_dtype)[0]
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load draft model {name!r}: {e}") from e


def check_draft(engine, draft, draft_model):
    """`draft` if it can draft for `engine`'s target: the same vocabulary (an error
    otherwise); a warning (once per draft) when it is not smaller than the target."""
    tc, dc = engine.config, draft.config
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(_vocab_mismatch(getattr(draft, 'name', '') or draft_model, dc.vocab_size,
                                         engine.name or 'model', tc.vocab_size))
    import jax

    size = lambda m: sum(x.size for x in jax.tree.leaves(m.params))  # noqa: E731
    warned = engine.stores.of(DraftStore).size_warned
    if id(draft) not in warned and size(draft) >= size(engine.model):
        warned.add(id(draft))
        log.warning("the draft model (%d params) is not smaller than the target (%d): SpecInfer "
                    "will be slower than plain decoding", size(draft), size(engine.model))
    return draft


def _vocab_mismatch(draft, draft_vocab: int, target, target_vocab: int) -> str:
    return (f"draft model {draft!r} has a vocabulary of {draft_vocab} tokens but the target {target} has "
            f"{target_vocab}: SpecInfer needs a draft with the target's tokenizer (e.g. a smaller model of "
            "the same family, or one made by python -m lookahead_jax.distill)")
