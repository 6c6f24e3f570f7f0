"""Plain decoding with several steps per device call (`Greedy(device_steps=K)`, a
`lax.while_loop` that stops each row on the device): the same tokens, log-probs, finish
reasons and texts as one step per call, for EOS, length and stop strings that fall inside a
block, sampling, min_new_tokens, penalties and requests that join mid-decode."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.strategies import Greedy
from tiny import ByteTokenizer, drive_slots, load_prompts, tiny_model

tok = ByteTokenizer()
PROMPTS = [p["prompt"][:100] for p in load_prompts(2)][:4]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=7)


def _rows(model, k, **kw):
    kw.setdefault("max_new_tokens", 21)
    out = generate(engine_for(model), tok, PROMPTS, strategy=Greedy(device_steps=k), logprobs=True,
                   max_cache_len=256, **kw)
    return [(r.token_ids, r.finish_reason, r.text, r.forward_steps, np.asarray(r.logprobs)) for r in out.rows]


def _same(a, b):
    for (ids, fin, text, steps, lp), (ids2, fin2, text2, steps2, lp2) in zip(a, b):
        assert (ids, fin, text, steps) == (ids2, fin2, text2, steps2)
        np.testing.assert_array_equal(lp, lp2)


@pytest.mark.parametrize("k", [2, 5, 8])
def test_blocks_of_steps_equal_single_steps(model, k):
    """Greedy and sampled, max_new_tokens not a multiple of K (rows stop mid-block)."""
    _same(_rows(model, k), _rows(model, 1))
    sampled = dict(temperature=0.8, top_p=0.9, seed=3)
    _same(_rows(model, k, **sampled), _rows(model, 1, **sampled))


def test_stops_inside_a_block(model):
    """An EOS id met mid-block by some rows (others run to their length), a stop string
    that ends mid-block, and min_new_tokens holding EOS back: as single steps give them."""
    plain = _rows(model, 1)
    eos = plain[0][0][6]  # row 0's 7th token: row 0 stops there, mid-block for K = 4
    got = _rows(model, 4, stop_token_ids=[eos])
    want = _rows(model, 1, stop_token_ids=[eos])
    _same(got, want)
    assert want[0][1] == "eos" and len(want[0][0]) == 7
    assert any(f == "length" for _, f, *_ in want)
    _same(_rows(model, 4, stop_token_ids=[eos], min_new_tokens=9),
          _rows(model, 1, stop_token_ids=[eos], min_new_tokens=9))
    stop = plain[1][2][5:8]  # a string row 1 writes at characters 5..7
    got, want = _rows(model, 4, stop=[stop]), _rows(model, 1, stop=[stop])
    _same(got, want)
    assert want[1][1] == "stop"


def test_penalties_take_single_steps(model):
    kw = dict(repetition_penalty=1.3, presence_penalty=0.5)
    _same(_rows(model, 6, **kw), _rows(model, 1, **kw))


def test_requests_joining_mid_decode(model):
    """Slots with device_steps: requests of different lengths inserted over time (the
    server's pattern) each get the tokens they get alone with single steps."""
    ids = [tok.encode(p) for p in PROMPTS]
    eng = engine_for(model)
    reqs = [Request(x, GenerationParams(max_new_tokens=n, seed=i)) for i, (x, n) in enumerate(zip(ids * 2, (5, 17, 9, 30, 12, 3, 23, 8)))]
    alone = []
    for r in reqs:
        s = Slots(eng, tok, 1, 256, Greedy())
        alone.append(drive_slots(s, [r])[0][1])
        s.close()
    s = Slots(eng, tok, 3, 256, Greedy(device_steps=4))
    got = drive_slots(s, reqs)
    assert [g[1] for g in got] == alone
    s.close()


def test_device_steps_is_checked():
    for bad in (0, 257, 2.0, True):
        with pytest.raises(ValueError, match="device_steps"):
            Greedy(device_steps=bad).validate()
