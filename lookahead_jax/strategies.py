"""Decoding strategies: what a `generate` call plugs into the decode loop.

A strategy is a frozen dataclass of its own options. `setup(engine, state, ...)` returns
the components of the loop for one call: (drafter, acceptance rule, budget policy). The
loop, the verify step and the output handling are the same for every strategy.

    generate(model, tok, prompts, strategy=Lookahead(decoding_length=7))
    generate(model, tok, prompts, strategy="lookahead", decoding_length=7)   # same

Adding a strategy = one dataclass with `setup` + one `register` line. The CLI builds
its flags from the dataclass fields (`--decoding-length`, `--branch-length`, ...;
`cli_names` renames one, e.g. mode -> `--lookahead-mode`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from . import tree as tree_lib
from .acceptance import SpecSampling, TokenMatch
from .budget import AutoBudget, FixedBudget, StepTimes, prior_costs
from .drafters.model import SAMPLERS

DRAFT_WEIGHTS = ("bfloat16", "float32")  # storage of a draft model's packed CPU weights

log = logging.getLogger("lookahead_jax")
REGISTRY: dict = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


@register
@dataclasses.dataclass(frozen=True)
class Greedy:
    """Plain decoding, one token per forward (greedy, or sampling with temperature > 0)."""

    name = "greedy"
    help = "plain decoding"
    cli_names = {}

    def validate(self) -> None:
        pass

    def max_nodes(self, drafter=None) -> int:
        return 0

    def setup(self, engine, state, drafter=None, references=None):
        return None, TokenMatch(state.sampling), FixedBudget(0)


@register
@dataclasses.dataclass(frozen=True)
class Lookahead:
    """n-gram trie drafts (prompt, references, past outputs) verified as one token tree
    per step; output identical to Greedy.

    decoding_length: draft nodes per step (0..128), or "auto": the budget that maximises
        expected tokens/s from verify costs among tree sizes T = 0, 1, 3, 7, 15, 31, 63
        (verify blocks of 1+T = 2^k tokens). Tuned on CPU; on a GPU a fixed 15 is faster
        for now.
    branch_length: maximum draft depth.  mode: hierarchical | parallel | single.
    calibrate: with "auto", time every tree size before the first request of a shape
        (~20-30 s on a 2-core CPU, compiling every size) instead of starting from the
        platform's typical costs (`budget.PRIOR_COST_RATIOS`). Either way the times of
        real steps correct the costs as decoding goes, and a tree size compiles when
        first used."""

    decoding_length: object = "auto"
    branch_length: int = 12
    mode: str = "hierarchical"
    calibrate: bool = False

    name = "lookahead"
    help = "n-gram trie drafts verified as a token tree (same tokens as greedy)"
    cli_names = {"mode": "lookahead-mode"}
    choices = {"mode": ("hierarchical", "parallel", "single")}
    field_help = {
        "calibrate": "true: with --decoding-length auto, time every tree size before decoding (~20-30 s "
                     "on a 2-core CPU) instead of starting from typical costs that real steps correct "
                     "(default false)",
    }

    @property
    def auto(self) -> bool:
        return self.decoding_length == "auto"

    def validate(self) -> None:
        dl = self.decoding_length
        if not self.auto and (not isinstance(dl, int) or isinstance(dl, bool)
                              or not 0 <= dl <= tree_lib.MAX_NODES):
            raise ValueError(f"decoding_length must be 'auto' or an integer in [0, {tree_lib.MAX_NODES}], got {dl!r}")

    def drafter(self, engine):
        from .drafters.trie import TrieDrafter  # greedy needs no trie

        return TrieDrafter.shared(engine, branch_length=self.branch_length, mode=self.mode)

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes if self.auto else self.decoding_length

    def setup(self, engine, state, drafter, references=None):
        rule = TokenMatch(state.sampling)
        drafter.begin(state, references)
        if not self.auto:
            return drafter, rule, FixedBudget(self.decoding_length)
        buckets = tuple(b for b in tree_lib.BUCKETS if b <= drafter.max_nodes)
        B, S = state.batch, state.max_len
        t0 = time.perf_counter()
        if self.calibrate:  # every bucket timed once per shape, at a typical length of this run
            mid = int(state.lengths.max()) + state.rows[0].max_new // 2
            costs = engine.measure_verify_costs(rule, B, S, buckets, mid)
        else:
            costs = prior_costs(engine.platform, buckets)
        times = engine.step_times.setdefault((rule, B, S), StepTimes())
        policy = AutoBudget(buckets, costs, getattr(drafter, "acceptance", None), times=times)
        policy.calibrate_s = time.perf_counter() - t0 if self.calibrate else 0.0
        return drafter, rule, policy


def _expansion(value) -> tuple:
    """--expansion "1,1,3,1" -> (1, 1, 3, 1)"""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    return tuple(int(v) for v in value)


@register
@dataclasses.dataclass(frozen=True)
class SpecInfer:
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
    lookahead_nodes: > 0 merges that many nodes of lookahead's n-gram trie (prompt, past
        outputs) into the draft model's tree each step (`drafters/merge.py`); greedy or
        sampler="invariant" only.
    draft_weights: "bfloat16" (default) stores the draft's packed CPU weights in bf16 and
        computes in f32: its forwards, which dominate a step on CPU, read half the bytes.
        The draft only proposes, so the output is unchanged (greedy: the target's tokens;
        sampling: the target's distribution); acceptance may move slightly. "float32": the
        draft exactly as loaded. Where the CPU kernels do not run (GPU/TPU, a mesh) the
        draft runs as loaded: load it in bf16 there."""

    draft_model: object = None
    expansion: tuple = (1, 1, 1, 1)
    sampler: str = "mss"
    lookahead_nodes: int = 0
    draft_weights: str = "bfloat16"

    name = "specinfer"
    help = "a draft model's token tree verified in one forward (greedy: same tokens; sampling: same distribution)"
    cli_names = {}
    choices = {"sampler": SAMPLERS, "draft_weights": DRAFT_WEIGHTS}
    parsers = {"expansion": _expansion, "draft_model": str}
    metavars = {"draft_model": "NAME_OR_PATH", "expansion": "W1,W2,..."}
    field_help = {
        "draft_model": "the draft model: a preset (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b) or "
                       "a local path (e.g. a python -m lookahead_jax.distill output); same tokenizer as --model",
        "expansion": "children per node at each depth of the draft tree (default 1,1,1,1: a chain of 4; SpecInfer's tree: 1,1,3,1,1,1,1,1)",
        "lookahead_nodes": "merge this many n-gram trie nodes (lookahead's drafts) into the draft model's "
                           "tree (default 0: none; greedy or --sampler invariant)",
        "sampler": "with --temperature > 0: mss = exact speculative sampling (the target's distribution); "
                   "invariant = the draft uses the target's random keys (the tokens of plain sampling "
                   "with the same --seed)",
        "draft_weights": "storage of the draft's weights on CPU: bfloat16 (default; half the bytes per draft "
                         "forward, f32 arithmetic, same output) or float32",
    }

    def __post_init__(self):
        if isinstance(self.expansion, (str, list)):
            object.__setattr__(self, "expansion", _expansion(self.expansion))

    def validate(self) -> None:
        from .drafters.model import check_expansion

        if self.draft_model is None or self.draft_model == "":
            raise ValueError("strategy 'specinfer' needs a draft model: draft_model=NAME_OR_PATH "
                             "(CLI: --draft-model), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be 'bfloat16' or 'float32', got {self.draft_weights!r}")
        from .drafters.model import expansion_tree

        n = len(expansion_tree(check_expansion(self.expansion, tree_lib.MAX_NODES))[0])
        if not isinstance(self.lookahead_nodes, int) or not 0 <= self.lookahead_nodes <= tree_lib.MAX_NODES - n:
            raise ValueError(f"lookahead_nodes must be an integer in [0, {tree_lib.MAX_NODES - n}] (the "
                             f"expansion's tree has {n} nodes, a step verifies at most {tree_lib.MAX_NODES}), "
                             f"got {self.lookahead_nodes!r}")

    def drafter(self, engine):
        from .drafters.model import ModelDrafter
        from .engine import engine_for

        model = ModelDrafter(draft_engine(engine, self.draft_model, self.draft_weights), self.expansion,
                             self.sampler)
        if not self.lookahead_nodes:
            return model
        from .drafters.merge import MergedDrafter
        from .drafters.trie import TrieDrafter

        return MergedDrafter(model, TrieDrafter.shared(engine, max_nodes=self.lookahead_nodes))

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes

    def setup(self, engine, state, drafter, references=None):
        mss = not state.sampling.greedy and self.sampler == "mss"
        if mss and self.lookahead_nodes:
            raise ValueError("lookahead_nodes > 0 merges trees, which are verified by matching tokens: "
                             "use temperature 0 or sampler='invariant'")
        drafter.begin(state, references)
        rule = SpecSampling(state.sampling) if mss else TokenMatch(state.sampling)
        return drafter, rule, FixedBudget(drafter.max_nodes)


def draft_engine(engine, draft_model, weights: str = "bfloat16"):
    """The Engine that runs the draft for `engine`'s target (`load_draft`), made once per
    (target engine, draft, weights). weights="bfloat16" on one CPU device: a private Engine
    whose packed weights are bf16 (`Engine.weight_dtype`), so a draft Model the caller
    passed in keeps its exact self elsewhere; "float32", or on a mesh: the draft's shared
    engine (`engine_for`)."""
    from .engine import Engine, engine_for

    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be 'bfloat16' or 'float32', got {weights!r}")
    by_name = isinstance(draft_model, str)
    engines = engine.shared.setdefault("draft_engines", {})
    key = (draft_model if by_name else id(draft_model), weights, engine.mesh is None)
    hit = engines.get(key)
    if hit is not None and (by_name or _runs(hit, draft_model)):
        return hit
    if weights == "float32" or engine.mesh is not None:
        eng = engine_for(load_draft(engine, draft_model), engine.mesh)
    else:
        # by name: a copy of our own (not the shared float32 one), whose bf16 packed
        # weights become its params (one copy in memory)
        # (loaded plain and packed into bf16 weight by weight: never its f32 and bf16 copies at once)
        draft = check_draft(engine, _load_by_name(engine, draft_model, keep_unpacked=True) if by_name
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
        cache = engine.shared.setdefault("draft_models", {})
        if draft_model not in cache:
            cache[draft_model] = _load_by_name(engine, draft_model)
        draft = cache[draft_model]
        if pack and engine.mesh is None:
            from .engine import engine_for

            engine_for(draft).keep_packed_only()
    else:
        draft = draft_model
    return check_draft(engine, draft, draft_model)


def _load_by_name(engine, name: str, keep_unpacked: bool = False):
    from .loading import load

    try:
        return load(name, dtype=engine.dtype, keep_unpacked=keep_unpacked)[0]
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load draft model {name!r}: {e}") from e


def check_draft(engine, draft, draft_model):
    """`draft` if it can draft for `engine`'s target: the same vocabulary (an error
    otherwise); a warning (once per draft) when it is not smaller than the target."""
    tc, dc = engine.config, draft.config
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(
            f"draft model {getattr(draft, 'name', '') or draft_model!r} has a vocabulary of {dc.vocab_size} "
            f"tokens but the target {engine.name or 'model'} has {tc.vocab_size}: SpecInfer needs a draft "
            "with the target's tokenizer (e.g. a smaller model of the same family, or one made by "
            "python -m lookahead_jax.distill)")
    import jax

    size = lambda m: sum(x.size for x in jax.tree.leaves(m.params))  # noqa: E731
    warned = engine.shared.setdefault("draft_size_warned", set())
    if id(draft) not in warned and size(draft) >= size(engine.model):
        warned.add(id(draft))
        log.warning("the draft model (%d params) is not smaller than the target (%d): SpecInfer "
                    "will be slower than plain decoding", size(draft), size(engine.model))
    return draft


def resolve(strategy, **options):
    """A strategy object from a name or an object; `options` are the strategy's fields
    given flat (`decoding_length=7`). Options of another strategy are ignored (with a
    warning unless left at their defaults); unknown options are an error."""
    if isinstance(strategy, str):
        if strategy not in REGISTRY:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {tuple(REGISTRY)}")
        cls = REGISTRY[strategy]
        fields = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in options.items() if k in fields}
        obj = cls(**mine)
    else:
        if type(strategy) not in REGISTRY.values():
            raise ValueError(f"strategy must be a name in {tuple(REGISTRY)} or one of their "
                             f"objects, got {strategy!r}")
        obj, fields = strategy, set()
    known = {f.name: f.default for c in REGISTRY.values() for f in dataclasses.fields(c)}
    for k, v in options.items():
        if k not in known:
            raise TypeError(f"generate() got an unexpected keyword argument {k!r}")
        if k not in fields and v != known[k]:
            log.warning("%s=%r is not an option of strategy %r: ignored", k, v, obj.name)
    obj.validate()
    return obj


def strategy_options() -> dict:
    """{field name: default} over every registered strategy (the flat keyword forms)."""
    return {f.name: f.default for c in REGISTRY.values() for f in dataclasses.fields(c)}


# retrieval-augmented decoding (ralm.py: the strategies that drive the loop themselves)
from .ralm import RaLM, RaLMSpec  # noqa: E402

register(RaLM)
register(RaLMSpec)

# KNN-LM (knnlm/): the next-token distribution mixed with the nearest datastore entries'
from .knnlm import KNNLM  # noqa: E402

register(KNNLM)


__all__ = ["Greedy", "Lookahead", "SpecInfer", "REGISTRY", "register", "resolve", "strategy_options"]

