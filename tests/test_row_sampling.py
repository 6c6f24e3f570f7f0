"""Per-request sampling parameters and penalties in one decode batch.

* Each row's filters and penalties (`RowSampling`, `RowPenalties`) compute bitwise what
  its own static `SamplingParams` / `Penalties` compute (greedy rows: the argmax).
* On `Slots`, a batch mixing greedy rows, sampled rows with different temperature /
  top-k / top-p / seed and rows with different penalties, inserted mid-decode, gives row
  for row the tokens each request gives alone (`generate` with its own values): plain
  decoding, lookahead and SpecInfer (speculative sampling: its rule and its draft take
  each row's values).
* Values never recompile; a greedy batch keeps the argmax step (no sort in it).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.sampling import (Penalties, RowPenalties, RowSampling, SamplingParams, filter_logits,
                                         penalize, select_tokens)
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.strategies import Lookahead, SpecInfer
from tiny import ByteTokenizer, load_prompts, tiny_model

MAX_NEW = 16
CACHE = 1024
TEXTS = [p["prompt"][:200] for p in load_prompts(2)][:5]

# (sampling, penalties, seed) per prompt: greedy, sampled with each filter, penalized rows
MIX = [
    (None, None, 0),
    (SamplingParams(0.8, 20, 1.0), Penalties(1.0, 0.4, 0.6), 3),
    (None, Penalties(1.3), 0),
    (SamplingParams(1.3, 0, 0.9), Penalties(1.2, -0.5, 1.0), 5),
    (SamplingParams(0.6, 0, 1.0), None, 7),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return [tok.encode(t) for t in TEXTS]


def alone(model, tok, i, **kw):
    """Prompt i with its own values of MIX, decoded alone by generate (sampling row i)."""
    sp, pen, seed = MIX[i]
    sp, pen = sp or SamplingParams(), pen or Penalties()
    return generate(model, tok, [TEXTS[i]], max_new_tokens=MAX_NEW, max_cache_len=CACHE, first_index=i,
                    temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seed,
                    repetition_penalty=pen.repetition, presence_penalty=pen.presence,
                    frequency_penalty=pen.frequency, **kw).token_ids[0]


def drive(slots, ids, order, every=2):
    """Insert the prompts `order` over time (one whenever a slot is free, after every
    `every` steps), each with its own MIX values; finished requests are freed at once."""
    queue, out, holder, n = list(order), {}, {}, 0
    while queue or slots.busy:
        if queue and slots.free_slots and n % every == 0:
            i = queue.pop(0)
            s = slots.free_slots[-1]
            sp, pen, seed = MIX[i]
            holder[s] = i
            for ev in slots.insert(s, Request(ids[i], GenerationParams.of(sp, pen, max_new_tokens=MAX_NEW, seed=seed),
                                              sampling_row=i)):
                if ev.finish:
                    out[i] = slots.free(s).ids
        for ev in slots.step():
            if ev.finish:
                out[holder[ev.slot]] = slots.free(ev.slot).ids
        n += 1
    return out


# ----------------------------------------------------------------------------- per-row math
def test_row_values_compute_what_each_rows_own_static_values_compute():
    rng = np.random.default_rng(0)
    V = 512
    sps = [SamplingParams(0.7), SamplingParams(), SamplingParams(1.3, 40), SamplingParams(0.9, 0, 0.8),
           SamplingParams(0.6, 10, 0.9), SamplingParams(1.0, V, 0.5), SamplingParams(2.0, 1)]
    B = len(sps)
    logits = jnp.asarray(rng.normal(size=(B, 3, V)).astype(np.float32) * 4)
    seed, row = jnp.arange(B, dtype=jnp.uint32), jnp.arange(B, dtype=jnp.int32)
    pos = jnp.tile(jnp.arange(3, dtype=jnp.int32), (B, 1)) + 9
    rs = RowSampling.of(sps)
    filt = np.asarray(jax.jit(filter_logits)(logits, rs))
    toks = np.asarray(jax.jit(select_tokens)(logits, rs, seed, row, pos))
    for b, sp in enumerate(sps):
        own = jax.jit(lambda l, s, r, p, sp=sp: select_tokens(l, sp, s, r, p))(
            logits[b:b + 1], seed[b:b + 1], row[b:b + 1], pos[b:b + 1])
        np.testing.assert_array_equal(toks[b:b + 1], np.asarray(own), err_msg=str(sp))
        if not sp.greedy:
            own_f = jax.jit(lambda l, sp=sp: filter_logits(l, sp))(logits[b:b + 1])
            np.testing.assert_array_equal(filt[b:b + 1], np.asarray(own_f), err_msg=str(sp))
    assert len(set(map(tuple, toks[:, 0:1].tolist()))) > 1  # the rows do differ

    pens = [Penalties(), Penalties(1.3), Penalties(1.0, 0.4, 0.6), Penalties(1.2, -0.5, 1.0)]
    seen = jnp.asarray(rng.random((4, V)) < 0.1)
    counts = jnp.asarray(rng.integers(0, 3, (4, V)), jnp.int32)
    rows = np.asarray(jax.jit(penalize)(logits[:4], RowPenalties.of(pens), seen, counts))
    for b, pen in enumerate(pens):
        own = jax.jit(lambda l, s, c, pen=pen: penalize(l, pen, s, c))(logits[b:b + 1], seen[b:b + 1],
                                                                      counts[b:b + 1])
        np.testing.assert_array_equal(rows[b:b + 1], np.asarray(own), err_msg=str(pen))
    assert not np.array_equal(rows[1], np.asarray(logits[1]))  # a penalty does change a row


# ----------------------------------------------------------------------------- one batch
@pytest.mark.parametrize("strategy,penalty_rows", [("plain", False), ("lookahead", False), ("lookahead", True)])
def test_mixed_batch_inserted_mid_decode_equals_alone(model, tok, ids, strategy, penalty_rows):
    strat = {"plain": None, "lookahead": Lookahead(decoding_length=7)}[strategy]
    engine = engine_for(model)
    slots = Slots(engine, tok, 2, CACHE, strat, eos_ids=tok.eos_token_ids, penalty_rows=penalty_rows)
    got = drive(slots, ids, [0, 1, 2, 3, 4])
    kw = {} if strat is None else dict(strategy="lookahead", decoding_length=7)
    for i in range(len(TEXTS)):
        assert got[i] == alone(model, tok, i, **kw), f"prompt {i}: {MIX[i]}"
    assert len({tuple(got[i]) for i in range(5)}) == 5


def test_values_never_recompile(model, tok, ids):
    """The same modes (sampled rows with top-k / top-p, both kinds of penalty) with other
    values, seeds and rows: nothing compiles again."""
    engine = engine_for(model)

    def run(scale):
        slots = Slots(engine, tok, 2, CACHE)  # no EOS: every row lives for all its steps
        reqs = []
        for i in (1, 3):
            sp, pen, seed = MIX[i]
            reqs.append(Request(ids[i], GenerationParams.of(
                SamplingParams(sp.temperature * scale, sp.top_k * scale, sp.top_p ** scale),
                Penalties(pen.repetition ** scale, pen.presence / scale, pen.frequency / scale),
                max_new_tokens=6, seed=seed + scale), sampling_row=i + scale))
        slots.insert([0, 1], reqs)
        while slots.busy:
            slots.step()
        return [slots.free(s).ids for s in range(2)]

    first = run(1)
    n = len(engine.compiled.compilations)
    assert run(2) != first
    assert engine.compiled.compilations[n:] == []


@pytest.mark.slow
def test_specinfer_mixed_batch_equals_alone(model, tok, ids):
    draft = tiny_model("llama", seed=2)
    strat = SpecInfer(draft_model=draft, expansion=(1, 1, 2), budget="fixed")
    slots = Slots(engine_for(model), tok, 2, CACHE, strat, eos_ids=tok.eos_token_ids)
    order = [1, 0, 3, 4]
    got = drive(slots, ids, order, every=3)
    for i in order:
        assert got[i] == alone(model, tok, i, strategy="specinfer", draft_model=draft, expansion=(1, 1, 2),
                                    budget="fixed"), \
            f"prompt {i}: {MIX[i]}"


def _unconditional(hlo: str) -> str:
    """The text of the computations an HLO module runs on every call: ENTRY and what it
    calls (fusions, loops, reductions), not the branches of a conditional (run only when
    their predicate says so)."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    seen, todo = set(), ["ENTRY"]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            line = re.sub(r"(branch_computations=\{[^}]*\}|true_computation=%?[\w.\-]+|false_computation=%?[\w.\-]+)",
                          "", line)
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
    return "\n".join(line for c in seen for line in comps[c])


def test_greedy_and_sampled_batches_share_one_step(model, tok, ids):
    """The sampling mode is data: a batch with a top-p row runs the very steps a greedy
    batch compiled (nothing compiles for it), and the sort over the vocabulary sits in a
    branch the step takes only when a row samples: a greedy batch sorts nothing."""
    engine = engine_for(model)

    def new_executables(requests):
        before = {id(e) for name in ("prefill", "verify") for e in engine.compiled.executables(name)}
        slots = Slots(engine, tok, 2, 512)
        slots.insert([0, 1], requests)
        while slots.busy:
            slots.step()
        return [e for name in ("prefill", "verify") for e in engine.compiled.executables(name)
                if id(e) not in before]

    greedy = new_executables([Request(ids[0][:40], GenerationParams(max_new_tokens=4)),
                              Request(ids[1][:40], GenerationParams(max_new_tokens=4))])
    n = len(engine.compiled.compilations)
    mixed = new_executables([Request(ids[0][:40], GenerationParams(max_new_tokens=4)),
                             Request(ids[1][:40], GenerationParams(max_new_tokens=4, temperature=0.7, top_k=0, top_p=0.9))])
    assert greedy and mixed == [] and engine.compiled.compilations[n:] == []
    texts = [e.as_text() for e in greedy]
    assert all("sort" in t for t in texts)  # the top-p branch is compiled in ...
    assert not any("sort" in _unconditional(t) for t in texts)  # ... and runs only when taken


@pytest.mark.parametrize("strategy", ["plain", "lookahead"])
def test_penalty_rows_share_the_steps_of_requests_without(model, tok, ids, strategy):
    """With `penalty_rows` (the server's slots) penalties are data like sampling values: a
    batch with repetition / presence / frequency penalties runs the very steps a batch
    without any compiled (nothing compiles for it, its tokens are each request's own), and
    the penalty work (the tree's path counts) sits in a branch a batch without penalties
    does not take."""
    strat = {"plain": None, "lookahead": Lookahead(decoding_length=7)}[strategy]
    engine = engine_for(model)

    def run(requests):
        before = {id(e) for name in ("prefill", "verify") for e in engine.compiled.executables(name)}
        slots = Slots(engine, tok, 2, 512, strat, penalty_rows=True)
        slots.insert([0, 1], requests)
        while slots.busy:
            slots.step()
        out = [slots.free(s).ids for s in range(2)]
        return out, [e for name in ("prefill", "verify") for e in engine.compiled.executables(name)
                     if id(e) not in before]

    plain, compiled = run([Request(ids[0][:40], GenerationParams(max_new_tokens=8)),
                           Request(ids[1][:40], GenerationParams(max_new_tokens=8))])
    n = len(engine.compiled.compilations)
    pens = [Penalties(1.3), Penalties(1.0, 0.4, 0.6)]
    got, again = run([Request(ids[0][:40], GenerationParams.of(penalties=pens[0], max_new_tokens=8)),
                      Request(ids[1][:40], GenerationParams.of(penalties=pens[1], max_new_tokens=8))])
    assert compiled and again == [] and engine.compiled.compilations[n:] == []
    kw = {} if strat is None else dict(strategy="lookahead", decoding_length=7)
    for i, pen in enumerate(pens):
        want = generate(engine.model, tok, [tok.decode(ids[i][:40])], max_new_tokens=8, max_cache_len=512,
                        repetition_penalty=pen.repetition, presence_penalty=pen.presence,
                        frequency_penalty=pen.frequency, **kw).token_ids[0]
        assert got[i] == want, pen
    assert got != plain  # the penalties did change the tokens
    if strategy == "lookahead":  # trees of T > 0: their path counts, s32[B,1+T,V], only when taken
        counts = re.compile(rf"s32\[2,\d+,{engine.config.vocab_size}\]")
        texts = [e.as_text() for e in compiled if counts.search(e.as_text())]
        assert texts and not any(counts.search(_unconditional(t)) for t in texts)
