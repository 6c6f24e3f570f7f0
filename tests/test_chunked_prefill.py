"""Chunked prefill on the slot API (`Slots(prefill_chunk=C)`): a long prompt is forwarded
one block of C tokens per step while the other slots keep decoding.

* A long prompt inserted while two requests decode gives exactly its tokens alone, and so
  do the others (greedy, lookahead, sampling; SpecInfer in the slow run), batch 3.
* While it prefills, every decoding slot gets tokens on each step, the long one none, for
  ceil((L - 1) / (C - 1)) - 1 steps after its insert; its first token comes in one event.
* `trees_while_prefilling` False: a step that carries a block verifies no tree, the tokens unchanged;
  with `blocks_at_insert` False an insert while others decode forwards no block.
* Many requests of mixed lengths queue their blocks (oldest first) and all equal alone.
* A step budget (`step_budget=k`): no block at insert while others decode, and each step
  carries the blocks that fit in k decode steps; the tokens are unchanged.
* Prompts at the edges of a block; free() of a prefilling slot cancels it and the slot
  is reused; with no request decoding (one slot, an idle server) a prompt is prefilled
  at insert; bad chunk sizes are errors.
* Through the server: tests/test_serve.py (test_chunked_prefill_server_equals_generate).
"""

from __future__ import annotations

import math

import pytest

from lookahead_jax.core.engine import Engine, engine_for
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.core.rows import Phase
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.strategies import Lookahead, SpecInfer
from tiny import ByteTokenizer, drive_slots, load_prompts, tiny_model

C = 16
CACHE = 1024
PROMPTS = [p["prompt"] for p in load_prompts()]
LONG = [PROMPTS[0][:250], PROMPTS[7][:180], PROMPTS[2][:120]]  # 251 / 181 / 121 byte tokens
SHORT = [PROMPTS[1][:15], PROMPTS[3][:12], PROMPTS[4][:40]]  # 16 / 13 (one block) / 41 tokens
SP = SamplingParams(0.8, 0, 0.95)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def alone(model, tok, text, row, max_new, sampling=None, seed=0):
    """`text` decoded alone by generate (greedy, or `sampling` with `seed`), sampling row `row`."""
    kw = {} if sampling is None else dict(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
    return generate(model, tok, [text], max_new_tokens=max_new, max_cache_len=CACHE, first_index=row,
                    **kw).token_ids[0]


def blocks(n_tokens: int) -> int:
    """Blocks a prompt of n_tokens > C takes (each re-forwards the last token of the one before)."""
    return math.ceil((n_tokens - 1) / (C - 1))


def collector(slots, got: dict, rows: dict):
    """A function taking a step's events: each slot's tokens appended to got[slot], a
    finished slot freed into rows[slot]."""
    def take(events):
        for ev in events:
            got[ev.slot] += ev.tokens
            if ev.finish:
                rows[ev.slot] = slots.free(ev.slot)
    return take


STRATEGIES = {
    "greedy": lambda model: (None, None),
    "lookahead": lambda model: (Lookahead(decoding_length=7), None),
    "sampling": lambda model: (Lookahead(decoding_length=7), SP),
    "specinfer": lambda model: (SpecInfer(draft_model=tiny_model("llama", seed=2), expansion=(1, 1, 2),
                                                   budget="fixed"), None),
}


@pytest.mark.parametrize("kind", ["greedy", "lookahead", "sampling",
                                  pytest.param("specinfer", marks=pytest.mark.slow)])
def test_long_prompt_prefills_in_chunks_while_others_decode(model, tok, kind):
    strat, sp = STRATEGIES[kind](model)
    seed = 5 if sp else 0
    slots = Slots(engine_for(model), tok, 3, CACHE, strat, sampling=sp or SamplingParams(), prefill_chunk=C)
    texts, max_new = {0: SHORT[0], 1: SHORT[1], 2: LONG[0]}, {0: 40, 1: 48, 2: 24}
    got = {b: [] for b in texts}
    rows = {}
    take = collector(slots, got, rows)

    first = slots.insert([0, 1], [Request(tok.encode(texts[b]), GenerationParams.of(sp, max_new_tokens=max_new[b], seed=seed),
                                          sampling_row=b)
                                  for b in (0, 1)])
    assert [len(ev.tokens) for ev in first] == [1, 1] and slots.prefilling == []  # one block each: whole
    take(first)
    for _ in range(2):
        take(slots.step())
    long_ids = tok.encode(texts[2])
    ev = slots.insert(2, Request(long_ids, GenerationParams.of(sp, max_new_tokens=max_new[2], seed=seed), sampling_row=2))
    assert ev[0].tokens == [] and ev[0].finish is None
    assert slots.prefilling == [2] and slots.busy == [0, 1, 2] and slots.free_slots == []
    assert slots.row(2).phase is Phase.PREFILLING and slots.row(2).finish is None and not slots.state.active[2]
    steps = 0
    while True:
        decoding = [b for b in (0, 1) if b not in rows]
        events = {e.slot: e for e in slots.step()}
        take(events.values())
        steps += 1
        for b in decoding:  # the running requests are not stalled by the long prefill
            assert events[b].tokens, (steps, b)
        if events[2].tokens:
            assert len(events[2].tokens) == 1 and slots.prefilling == [] and slots.state.active[2]
            break
        assert slots.prefilling == [2]
    assert steps == blocks(len(long_ids)) - 1 == 16
    while slots.busy:
        take(slots.step())
    for b, text in texts.items():
        want = alone(model, tok, text, b, max_new[b], sp, seed)
        assert got[b] == rows[b].ids == want, (kind, b)
    assert rows[2].prompt_ids == long_ids and slots.free_slots == [0, 1, 2]


def test_wide_blocks_past_512_tokens_match_the_prompt_alone(model, tok):
    """64-token blocks of a 700-token prompt climb the windows 128 / 512 / 1,024; from 512
    on they take the CPU attention kernel (`cpu_kernels.MIN_PREFILL_ATTN_WINDOW`, issue
    57; elsewhere the jnp definition): the row's tokens are those of the prompt alone
    (prefilled whole), and the decoding row's are its own."""
    from lookahead_jax.models import cpu_kernels

    assert cpu_kernels.MIN_PREFILL_ATTN_WINDOW <= 512 < CACHE
    slots = Slots(engine_for(model), tok, 2, CACHE, Lookahead(decoding_length=7), prefill_chunk=64)
    texts, max_new = {0: SHORT[2], 1: (PROMPTS[0] + " " + PROMPTS[7] + " " + PROMPTS[2])[:700]}, {0: 60, 1: 12}
    assert len(tok.encode(texts[1])) > 512 + 64
    got, rows = {0: [], 1: []}, {}
    take = collector(slots, got, rows)
    take(slots.insert(0, Request(tok.encode(texts[0]), GenerationParams(max_new_tokens=max_new[0]), sampling_row=0)))
    take(slots.step())
    take(slots.insert(1, Request(tok.encode(texts[1]), GenerationParams(max_new_tokens=max_new[1]), sampling_row=1)))
    assert slots.prefilling == [1]
    while slots.busy:
        take(slots.step())
    for b, text in texts.items():
        assert got[b] == rows[b].ids == alone(model, tok, text, b, max_new[b]), b


@pytest.mark.parametrize("kind", ["lookahead", "sampling"])
@pytest.mark.parametrize("trees", [False, True])
def test_steps_with_a_block_verify_no_tree(model, tok, kind, trees):
    """With `trees_while_prefilling` False a step that carries a prefill block verifies no
    tree (`budget.NoTree`) and the steps after it draft again; with trees (the default) or
    without, every request's tokens are its tokens alone."""
    strat, sp = STRATEGIES[kind](model)
    seed = 5 if sp else 0
    slots = Slots(engine_for(model), tok, 2, CACHE, strat, sampling=sp or SamplingParams(), prefill_chunk=C)
    slots.trees_while_prefilling = trees
    texts, max_new = {0: PROMPTS[5][:30], 1: LONG[1]}, {0: 120, 1: 16}
    got, rows = {b: [] for b in texts}, {}
    take = collector(slots, got, rows)
    mk = lambda b: Request(tok.encode(texts[b]), GenerationParams.of(sp, max_new_tokens=max_new[b], seed=seed),
                           sampling_row=b)
    take(slots.insert(0, mk(0)))
    take(slots.insert(1, mk(1)))
    with_block, after = [], []
    while slots.busy:
        prefilling = bool(slots.prefilling)
        take(slots.step())
        if slots.last_step is not None:
            (with_block if prefilling else after).append(slots.last_step.T)
    assert len(with_block) == blocks(len(tok.encode(texts[1]))) - 1 and after
    if not trees:
        assert set(with_block) == {0}
    assert any(after), "the steps after the prefill draft again"
    for b, text in texts.items():
        assert got[b] == rows[b].ids == alone(model, tok, text, b, max_new[b], sp, seed), (kind, trees, b)


@pytest.mark.parametrize("kind", ["greedy", "lookahead", "sampling"])
def test_no_block_at_insert(model, tok, kind):
    """`blocks_at_insert` False: an insert while others decode forwards nothing (the prompt
    keeps its length 0), each step then carries one block, so the long prompt takes one
    step per block; short prompts too; every request's tokens are its tokens alone."""
    strat, sp = STRATEGIES[kind](model)
    seed = 5 if sp else 0
    slots = Slots(engine_for(model), tok, 3, CACHE, strat, sampling=sp or SamplingParams(), prefill_chunk=C)
    slots.blocks_at_insert = False
    texts, max_new = {0: SHORT[2], 1: SHORT[1], 2: LONG[2]}, {0: 80, 1: 12, 2: 16}
    got, rows = {b: [] for b in texts}, {}
    take = collector(slots, got, rows)
    mk = lambda b: Request(tok.encode(texts[b]), GenerationParams.of(sp, max_new_tokens=max_new[b], seed=seed),
                           sampling_row=b)
    take(slots.insert(0, mk(0)))  # nothing decoding: prefilled at insert
    assert got[0] and slots.prefilling == []
    for b in (1, 2):
        ev = slots.insert(b, mk(b))
        assert ev[0].tokens == [] and slots.row(b).phase is Phase.PREFILLING and int(slots.state.lengths[b]) == 0
    steps = 0
    while 2 in slots.prefilling:
        take(slots.step())
        steps += 1
    assert steps == 1 + blocks(len(tok.encode(texts[2])))  # the short prompt's one block, then the long one's
    while slots.busy:
        take(slots.step())
    for b, text in texts.items():
        assert got[b] == rows[b].ids == alone(model, tok, text, b, max_new[b], sp, seed), (kind, b)


def test_mixed_lengths_queue_their_blocks(model, tok):
    """Six requests (three over C tokens) through 3 slots, a new one whenever a slot is
    free: several prompts prefill at once, one block per step, and every one of them gives
    its tokens alone (lookahead)."""
    strat = Lookahead(decoding_length=7)
    slots = Slots(engine_for(model), tok, 3, CACHE, strat, prefill_chunk=C)
    texts = [LONG[0], SHORT[2], LONG[1], SHORT[0], LONG[2], SHORT[1]]
    reqs = [Request(tok.encode(t), GenerationParams(max_new_tokens=20), sampling_row=i) for i, t in enumerate(texts)]
    seen = []
    step = slots.step

    def watched():  # how many slots prefill at each step
        seen.append(len(slots.prefilling))
        return step()

    slots.step = watched
    out = drive_slots(slots, reqs, every=1)
    assert max(seen) >= 2  # blocks of several prompts waited their turn
    for i, (row, events) in enumerate(out):
        assert events == row.ids == alone(model, tok, texts[i], i, 20), i
    assert slots.free_slots == [0, 1, 2] and slots.prefilling == []


@pytest.mark.parametrize("shortest", [True, False])
def test_the_prompt_with_the_fewest_tokens_left_prefills_first(model, tok, monkeypatch, shortest):
    """While a request decodes, a long prompt and then a shorter one wait for blocks: the
    step serves the one with fewer tokens left first (`Slots.shortest_first`), so the short
    one gets its first token after its own blocks; oldest first, after the long one's.
    Either way every request gives its tokens alone."""
    monkeypatch.setattr(Slots, "shortest_first", shortest)
    slots = Slots(engine_for(model), tok, 3, CACHE, Lookahead(decoding_length=7), prefill_chunk=C)
    got = {0: list(slots.insert(0, Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=200), sampling_row=0))[0].tokens),
           1: [], 2: []}
    rows = {}
    take = collector(slots, got, rows)
    take(slots.step())
    texts = {1: LONG[0], 2: LONG[2]}  # 251 then 121 tokens
    for s in (1, 2):
        take(slots.insert(s, Request(tok.encode(texts[s]), GenerationParams(max_new_tokens=8), sampling_row=s)))
    first_token = {}
    n = 0
    while slots.prefilling:
        take(slots.step())
        n += 1
        for s in (1, 2):
            if got[s] and s not in first_token:
                first_token[s] = n
    assert set(first_token) == {1, 2}
    if shortest:
        assert first_token[2] < first_token[1]
        assert first_token[2] == blocks(len(tok.encode(texts[2]))) - 1  # its own blocks only (one at insert)
    else:
        assert first_token[1] < first_token[2]
    while slots.busy:
        take(slots.step())
    assert got[0] == rows[0].ids == alone(model, tok, SHORT[2], 0, 200)
    for s in (1, 2):
        assert got[s] == rows[s].ids == alone(model, tok, texts[s], s, 8)


def test_free_a_prefilling_slot_and_reuse_it(model, tok):
    slots = Slots(engine_for(model), tok, 2, CACHE, Lookahead(decoding_length=7), prefill_chunk=C)
    slots.insert(0, Request(tok.encode(SHORT[0]), GenerationParams(max_new_tokens=30), sampling_row=0))
    long_ids = tok.encode(LONG[0])
    slots.insert(1, Request(long_ids, GenerationParams(max_new_tokens=16), sampling_row=1))
    for _ in range(3):
        assert all(not e.tokens for e in slots.step() if e.slot == 1)
    row = slots.free(1)  # cancelled mid-prefill
    assert row.finish == "abort" and row.ids == [] and row.prompt_ids == long_ids
    assert slots.prefilling == [] and slots.free_slots == [1] and slots.busy == [0]
    with pytest.raises(ValueError, match="already free"):
        slots.free(1)
    got = {0: [], 1: []}
    rows = {}
    got[1] += slots.insert(1, Request(tok.encode(LONG[1]), GenerationParams(max_new_tokens=16), sampling_row=1))[0].tokens  # reused
    while slots.busy:
        for ev in slots.step():
            got[ev.slot] += ev.tokens
            if ev.finish:
                rows[ev.slot] = slots.free(ev.slot)
    assert got[1] == rows[1].ids == alone(model, tok, LONG[1], 1, 16)
    assert rows[0].ids == alone(model, tok, SHORT[0], 0, 30)
    # a request whose first token is its last: finished in the step that ends its prefill
    slots.insert(1, Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=40), sampling_row=2))  # decoding beside it
    slots.insert(0, Request(long_ids, GenerationParams(max_new_tokens=1), sampling_row=1))
    events = []
    while slots.row(0).finish is None:
        events += [e for e in slots.step() if e.slot == 0]
    assert [(e.tokens, e.finish) for e in events][-1] == (alone(model, tok, LONG[0], 1, 1), "length")
    assert all(not e.tokens and e.finish is None for e in events[:-1]) and len(events) == blocks(len(long_ids)) - 1


def test_lengths_at_block_edges(model, tok):
    """Prompts of C, C + 1, 2C - 1, 2C and 3C tokens inserted while another request
    decodes: each takes the blocks the rule gives (at insert its first, and its second too
    when that is its last, so a prompt of two blocks has its first token at insert; then
    one a step) and its tokens alone."""
    slots = Slots(engine_for(model), tok, 2, CACHE, prefill_chunk=C)
    slots.insert(1, Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=200), sampling_row=2))  # keeps decoding throughout
    for n in (C, C + 1, 2 * C - 1, 2 * C, 3 * C):
        text = PROMPTS[5][:n - 1]  # BOS + n - 1 bytes
        ids = tok.encode(text)
        first = slots.insert(0, Request(ids, GenerationParams(max_new_tokens=8), sampling_row=3))[0].tokens
        got, steps = list(first), 0
        while not got:
            got += slots.step()[0].tokens
            steps += 1
        assert steps == (0 if blocks(n) <= 2 else blocks(n) - 1), n  # (2C tokens: 3 blocks)
        while slots.row(0).finish is None:
            got += slots.step()[0].tokens
        assert got == slots.free(0).ids == alone(model, tok, text, 3, 8), n
    assert slots.busy == [1]


@pytest.mark.parametrize("ready", ["in place", "compiled", "not compiled"])
def test_a_short_last_piece_takes_the_narrower_block(model, tok, monkeypatch, ready):
    """With blocks of 32 a prompt's last piece of at most 16 tokens goes in a 16-token block
    (`DecodeState.tail`), a longer one in the full block, the non-last ones always in the
    full block, and every request's tokens are those alone, batch 3 with another request
    decoding. ready: slots without `fallback` compile the narrower block in place; with it,
    a warmed-up one is taken ("compiled") and one never compiled gives way to the full
    block ("not compiled": the listed programs minus the narrower one)."""
    from lookahead_jax.core import decode, programs

    chunk = 32
    eng = Engine(model)  # (its own: what another test's engine compiled does not count)
    slots = Slots(eng, tok, 3, CACHE, prefill_chunk=chunk, fallback=ready != "in place")
    assert slots.state.tail == 16 and any(p.kind == "prefill" and p.tokens == 16 for p in slots.programs())
    if ready != "in place":
        inventory = programs.inventory
        monkeypatch.setattr(programs, "inventory", lambda s: [p for p in inventory(s) if ready == "compiled"
                                                               or p.tokens != 16])
        slots.warm_up(wait="all")
    widths = []  # (block width, tokens forwarded, emits) of every prefill block
    extend_block = decode.extend_block

    def spy(engine, state, group, block, n_new, **kw):
        if kw.get("ahead") is None:
            widths.append((block.shape[1], int(n_new.max()), kw["emit"]))
        return extend_block(engine, state, group, block, n_new, **kw)

    monkeypatch.setattr(decode, "extend_block", spy)
    # 40 tokens: a block of 32 (31 committed), then 9 (the narrower block); 60: 32, then 29
    # (the full block); 20: one piece of 20 (full); 12: one piece (narrower)
    texts = [PROMPTS[5][:39], PROMPTS[6][:59], PROMPTS[1][:19], PROMPTS[3][:11]]
    reqs = [Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=60), sampling_row=9)] + \
        [Request(tok.encode(t), GenerationParams(max_new_tokens=10), sampling_row=i) for i, t in enumerate(texts)]
    done = drive_slots(slots, reqs, every=1)
    monkeypatch.setattr(decode, "extend_block", extend_block)
    for (row, got), (i, text) in zip(done[1:], enumerate(texts)):
        assert got == row.ids == alone(model, tok, text, i, 10), text
    assert all(w == chunk for w, _, emit in widths if not emit)  # the non-last pieces
    narrow = 16 if ready != "not compiled" else chunk
    # the last pieces: the four prompts', and the first request's (41 tokens: 32, then 10)
    assert sorted((n, w) for w, n, emit in widths if emit) == [(9, narrow), (10, narrow), (12, narrow), (20, chunk),
                                                               (29, chunk)]


def test_nothing_decoding_means_a_whole_prefill(model, tok):
    """Chunks only keep running requests decoding: with none running (one slot, or an idle
    server), a long prompt is forwarded at insert (all its blocks, each of the chunk's one
    shape), its first token out at once."""
    slots = Slots(engine_for(model), tok, 2, CACHE, prefill_chunk=C)
    ids = tok.encode(LONG[0])
    first = slots.insert(0, Request(ids, GenerationParams(max_new_tokens=8), sampling_row=0))[0].tokens
    assert first and slots.prefilling == [] and slots.busy == [0]
    got = list(first)
    while slots.busy:
        got += slots.step()[0].tokens
    assert got == alone(model, tok, LONG[0], 0, 8)


def budget_slots(model, tok, monkeypatch, strategy, budget):
    """Slots with a `step_budget` on a fake clock: a decode step costs 1, a prefill block 1.
    Returns (slots, counts): counts[-1] is the blocks forwarded since the caller last
    appended a 0."""
    import lookahead_jax.core.slots as slots_mod

    now = [0.0]
    real_step = slots_mod.step

    def decode_step(*a, **kw):
        now[0] += 1.0
        return real_step(*a, **kw)

    monkeypatch.setattr(slots_mod, "step", decode_step)
    slots = Slots(engine_for(model), tok, 2, CACHE, strategy, prefill_chunk=C, step_budget=budget)
    slots._clock = lambda: now[0]
    forward, counts = slots._forward_chunks, [0]

    def block(ss):
        now[0] += 1.0
        counts[-1] += 1
        return forward(ss)

    slots._forward_chunks = block
    return slots, counts


@pytest.mark.parametrize("budget", [None, 3, 1e9])
def test_step_budget_fills_a_step_with_blocks(model, tok, monkeypatch, budget):
    """With a step budget k, a prompt inserted while another request decodes gets no block
    at insert, and each step carries the blocks that fit in k decode steps of the running
    batch (a fake clock: a decode step costs 1, a block 1: k = 3 fits the decode and two
    blocks, a huge k every block in one step; None: the first block at insert, then one a
    step). Both requests give their tokens alone."""
    slots, counts = budget_slots(model, tok, monkeypatch, Lookahead(decoding_length=7), budget)
    got = {0: list(slots.insert(0, Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=200), sampling_row=0))[0].tokens), 1: []}
    rows = {}
    take = collector(slots, got, rows)

    for _ in range(3):  # the running request's decode steps: the budget's unit
        take(slots.step())
    long_ids = tok.encode(LONG[0])
    counts.append(0)
    take(slots.insert(1, Request(long_ids, GenerationParams(max_new_tokens=8), sampling_row=1)))
    at_insert = counts[-1]
    per_step = []
    while 1 in slots.prefilling:
        counts.append(0)
        take(slots.step())
        per_step.append(counts[-1])
    assert 0 not in rows  # the first request decoded all along
    n = blocks(len(long_ids))
    if budget is None:
        assert at_insert == 1 and per_step == [1] * (n - 1)
    elif budget == 3:
        assert at_insert == 0 and per_step == [2] * (n // 2) + [1] * (n % 2)
    else:
        assert at_insert == 0 and per_step == [n]
    while slots.busy:
        take(slots.step())
    assert got[0] == rows[0].ids == alone(model, tok, SHORT[2], 0, 200)
    assert got[1] == rows[1].ids == alone(model, tok, LONG[0], 1, 8)


def test_the_step_a_request_finishes_in_keeps_to_the_budget(model, tok, monkeypatch):
    """A step whose decoding rows all finish in it still carries only the blocks that fit
    its budget (their last tokens go out with its events, which every block at once would
    hold); the next step, with nothing decoding, forwards every remaining block. A fake
    clock (`budget_slots`): decode 1, block 1, k = 3 (two blocks a step)."""
    slots, counts = budget_slots(model, tok, monkeypatch, None, 3)
    got = {0: list(slots.insert(0, Request(tok.encode(SHORT[2]), GenerationParams(max_new_tokens=6), sampling_row=0))[0].tokens), 1: []}
    rows = {}
    take = collector(slots, got, rows)
    take(slots.step())
    take(slots.step())  # (the running request's decode steps: the budget's unit)
    long_ids = tok.encode(LONG[0])
    take(slots.insert(1, Request(long_ids, GenerationParams(max_new_tokens=8), sampling_row=1)))
    per_step, finished_at = [], None
    while 1 in slots.prefilling:
        counts.append(0)
        events = slots.step()
        take(events)
        per_step.append(counts[-1])
        if finished_at is None and any(ev.slot == 0 and ev.finish for ev in events):
            finished_at = len(per_step) - 1
    n = blocks(len(long_ids))
    assert finished_at is not None and finished_at + 2 <= len(per_step)  # it ended while the long prompt prefilled
    assert per_step[:finished_at + 1] == [2] * (finished_at + 1)  # the step it ended in too
    assert per_step[finished_at + 1:] == [n - 2 * (finished_at + 1)]  # then nothing decodes: every block
    while slots.busy:
        take(slots.step())
    assert got[0] == rows[0].ids == alone(model, tok, SHORT[2], 0, 6)
    assert got[1] == rows[1].ids == alone(model, tok, LONG[0], 1, 8)


@pytest.mark.parametrize("budget", [0, 0.5, "3", -1, True])
def test_step_budget_must_be_one_or_more(model, tok, budget):
    with pytest.raises(ValueError, match="step_budget must be a number >= 1"):
        Slots(engine_for(model), tok, 2, 256, prefill_chunk=C, step_budget=budget)


@pytest.mark.parametrize("chunk", [0, 1, -4, 2.5, "16", True])
def test_prefill_chunk_must_be_an_integer_of_two_or_more(model, tok, chunk):
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 2"):
        Slots(engine_for(model), tok, 2, 256, prefill_chunk=chunk)
