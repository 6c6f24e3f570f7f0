"""The order of the prefilling slots' blocks (`core.prefill_order.PrefillOrder`,
`Slots._next_prefill`): shortest remaining first, the oldest among equals, and a slot
passed over for `max_wait` blocks in a row goes next; oldest first when asked. Through
`Slots`: a long prompt among a stream of shorter ones takes a block at least every
max_wait + 1 steps (and waits longer without the bound), every request's tokens those it
gets alone."""

from __future__ import annotations

import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.prefill_order import PrefillOrder
from lookahead_jax.core.slots import Request, Slots
from tiny import ByteTokenizer, load_prompts, tiny_model

C = 16
CACHE = 1024
PROMPTS = [p["prompt"] for p in load_prompts()]


def test_the_fewest_tokens_left_first_the_oldest_among_equals():
    order = PrefillOrder()
    assert order.pick({3: 100, 1: 40, 2: 40}) == 1  # (dict order: the order they began)
    assert order.pick({3: 100, 2: 40}) == 2
    assert PrefillOrder(shortest_first=False).pick({3: 100, 1: 40}) == 3


def test_a_slot_passed_over_max_wait_times_goes_next():
    order = PrefillOrder(max_wait=2)
    picks = [order.pick({0: 500, 1: 10}) for _ in range(6)]
    assert picks == [1, 1, 0, 1, 1, 0]
    order = PrefillOrder(max_wait=2)  # two overdue: the longest passed over first
    order.waited = {0: 3, 1: 2, 2: 0}
    assert order.pick({0: 500, 1: 400, 2: 10}) == 0
    assert order.pick({0: 500, 1: 400, 2: 10}) == 1
    order.begin(1)  # a new prompt in slot 1: it has waited for nothing
    assert order.waited[1] == 0 and order.pick({0: 500, 1: 400, 2: 10}) == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_max_wait_must_be_one_or_more(bad):
    with pytest.raises(ValueError, match="max_wait must be 1 or more"):
        PrefillOrder(max_wait=bad)


@pytest.mark.parametrize("max_wait", [2, 1000])
def test_a_long_prompt_among_a_stream_of_shorter_ones_is_not_starved(monkeypatch, max_wait):
    """Slot 0 decodes throughout, slot 1 prefills a 251-token prompt (16 blocks) while slots
    2 and 3 take one 41-to-81-token prompt after another (3-5 blocks each, each refilled as
    soon as it finishes). With max_wait 2 the long prompt never goes more than 2 steps
    without a block; without the bound (1000) it waits longer while the stream lasts."""
    monkeypatch.setattr(Slots, "max_prefill_wait", max_wait)
    model, tok = tiny_model("llama"), ByteTokenizer()
    slots = Slots(engine_for(model), tok, 4, CACHE, prefill_chunk=C)
    slots.insert(0, Request(tok.encode(PROMPTS[1][:30]), GenerationParams(max_new_tokens=400), sampling_row=0))
    slots.step()
    long_text = PROMPTS[0][:250]
    slots.insert(1, Request(tok.encode(long_text), GenerationParams(max_new_tokens=4), sampling_row=1))
    stream = [PROMPTS[2 + i % 6][:40 + 10 * (i % 5)] for i in range(14)]
    texts, done, waits, run = {1: long_text}, [], [], 0

    def take(events):
        for ev in events:
            if ev.finish and ev.slot != 0:
                done.append((texts[ev.slot], ev.slot, slots.free(ev.slot).ids))

    while 1 in slots.prefilling or stream:
        for s in (2, 3):
            if s in slots.free_slots and stream:
                texts[s] = stream.pop(0)
                take(slots.insert(s, Request(tok.encode(texts[s]), GenerationParams(max_new_tokens=2),
                                             sampling_row=s)))
        before, others = int(slots.state.lengths[1]), [s for s in slots.prefilling if s != 1]
        prefilling = 1 in slots.prefilling
        take(slots.step())
        if prefilling:  # steps in a row whose block went to another slot
            run = 0 if int(slots.state.lengths[1]) != before or not others else run + 1
            waits.append(run)
    while slots.busy != [0]:
        take(slots.step())
    if max_wait == 2:
        assert max(waits) <= 2, waits
    else:
        assert max(waits) > 2, waits
    from test_chunked_prefill import alone
    assert len(done) == 15  # the long prompt and the 14 of the stream
    for text, s, ids in done:
        assert ids == alone(model, tok, text, s, 4 if text == long_text else 2), text
