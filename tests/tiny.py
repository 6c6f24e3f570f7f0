"""Tiny models and a byte-level tokenizer for fast tests (no downloads, no real weights)."""

from __future__ import annotations

import json
import pathlib
import types

import jax
import numpy as np

from lookahead_jax.loading import release_memory  # noqa: F401  (gc + glibc malloc_trim, for the tests)
from lookahead_jax.models import ModelConfig, init_params

DATA = pathlib.Path(__file__).parent / "data"


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258; 0 = pad, 1 = BOS, 2 = EOS."""

    eos_token_ids = {2}
    bos_token_id = 1
    pad_token_id = 0
    vocab_size = 259

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def tiny_config(family="llama", **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=16, d_ff=128, tie_embeddings=False, max_position=4096)
    if family == "qwen2":
        base.update(qkv_bias=True)
    if family == "gemma3":
        base.update(layer_types=("sliding", "full"), sliding_window=16, qk_norm=True,
                    sandwich_norm=True, embed_scale=True, act="gelu_tanh",
                    query_pre_attn_scalar=16, rope_theta=1e6)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(family="llama", seed=0, head_scale=6.0, **kw):
    """A random model whose sharpened head gives varied, non-degenerate greedy text."""
    cfg = tiny_config(family, **kw)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"] * head_scale
    return types.SimpleNamespace(config=cfg, params=params, name=f"tiny-{family}", dtype=np.float32)


def load_prompts(n_per_source=None):
    rows = [json.loads(line) for line in open(DATA / "prompts.jsonl")]
    if n_per_source is None:
        return rows
    out, seen = [], {}
    for r in rows:
        if seen.get(r["source"], 0) < n_per_source:
            seen[r["source"]] = seen.get(r["source"], 0) + 1
            out.append(r)
    return out


def drive_slots(slots, requests, every=2):
    """Insert `requests` (a list of `core.slots.Request`) into `slots` over time: the next
    one whenever a slot is free, after every `every` steps (the highest free slot, so they
    land in varied slots); a finished request is freed at once. Returns per request
    (its freed row, the tokens its events carried, in order)."""
    queue, out, holder, got, n = list(enumerate(requests)), {}, {}, {}, 0

    def take(events):
        for ev in events:
            i = holder[ev.slot]
            got[i] += ev.tokens
            if ev.finish:
                out[i] = (slots.free(ev.slot), got[i])

    while queue or slots.busy:
        if queue and slots.free_slots and n % every == 0:
            i, req = queue.pop(0)
            s = slots.free_slots[-1]
            holder[s], got[i] = i, []
            take(slots.insert(s, req))
        take(slots.step())
        n += 1
    return [out[i] for i in range(len(requests))]



def own_word_passages(model, tok, prompts, n: int, new_tokens: int) -> list:
    """n passages of 3-11 words drawn (seed 0) from the model's own greedy output words on
    `prompts` and the prompts' words, passage 7 with an id and a title: a corpus whose
    top-1 passage changes while the model decodes (the retrieval tests' kind)."""
    import re

    from lookahead_jax.generate import generate

    out = generate(model, tok, prompts, max_new_tokens=new_tokens)
    words = set()
    for r in out.rows:
        words |= {w.lower() for w in re.findall(r"[A-Za-z0-9]{2,}", r.text)}
    for p in prompts:
        words |= {w.lower() for w in re.findall(r"[A-Za-z]{3,}", p)}
    words = sorted(words)
    rng = np.random.default_rng(0)
    passages = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(n)]
    passages[7] = {"id": "titled", "title": "A title", "text": passages[7]}
    return passages


def pin_verify_costs(monkeypatch, ratio):
    """Lookahead auto's starting costs t(T)/t(0) = ratio(T), and no real step corrects them
    (whatever this host's load makes real steps measure, in this test or an earlier one on
    the same engine)."""
    from lookahead_jax.core import budget as budget_lib
    from lookahead_jax.strategies import lookahead as lookahead_strategy

    monkeypatch.setattr(lookahead_strategy, "prior_costs",
                        lambda platform, buckets, batch=1: {b: ratio(b) for b in buckets})
    monkeypatch.setattr(budget_lib.StepTimes, "record", lambda self, T, window, seconds: None)
    # nor do ratios that earlier tests' real steps left in the engine's shared StepTimes
    monkeypatch.setattr(budget_lib.StepTimes, "ratio", lambda self, T: (None, 0))


class EditRun:
    """Test-only `strategies.base.Run` written against the plug-in edits alone (as knnlm's
    run uses them): plugged into `Slots(run=...)`, each turn is the loop's verify step
    (`core.decode.step`), or, when the test queued one, a turn of its own
    (`edits`: callables (engine, state, drafter, rule, budget), run one a turn, oldest
    first; e.g. `decode.rollback` + `decode.accept`, with or without a step before). The
    tokens of row b past `hold[b]` are held from the events until the test drops the entry
    (a turn may still take them back)."""

    extra_tokens, extra_note, picks_first_token = 0, "", False

    def __init__(self):
        self.edits: list = []
        self.hold: dict = {}

    def add(self, state, rows, prompt_ids, spans=None) -> list:
        return list(prompt_ids)

    def step(self, engine, state, drafter, rule, budget) -> None:
        if self.edits:
            self.edits.pop(0)(engine, state, drafter, rule, budget)
        else:
            from lookahead_jax.core.decode import step

            step(engine, state, drafter, rule, budget)

    def final_upto(self, state, b: int) -> int:
        return min(len(state.rows[b].ids), self.hold.get(b, len(state.rows[b].ids)))

    def remove(self, rows) -> None:
        pass

    def close(self) -> None:
        pass

    def row_stats(self, b: int):
        return None

    def summary(self) -> dict:
        return {}


def force_token(b: int, token: int):
    """An `EditRun` turn that puts `token` in row b's output as a plug-in does (knnlm's
    correction): the loop's step forwards the root (its K/V lands at slot lengths[b]) and
    picks a token, which is taken back (`decode.rollback` to that slot) and replaced
    (`decode.accept` of `token`, the root's K/V already cached)."""

    def turn(engine, state, drafter, rule, budget):
        from lookahead_jax.core.decode import accept, rollback, step

        step(engine, state, drafter, rule, budget)
        rollback(state, [b], int(state.lengths[b]) - 1, drafter)
        accept(state, [b], [token])

    return turn
