"""`GenerationParams`: a request's options, checked in one place (core/params.py).

Every front end (generate's keyword arguments, the CLI's flags, the server's protocol)
builds one; a bad value is a `ParamError` naming the field, which each front end words
in its own spelling (the CLI's and the server's are tested in test_cli / test_serve*)."""

from __future__ import annotations

import math

import pytest

from lookahead_jax.core.params import GenerationParams, ParamError, Penalties, SamplingParams
from lookahead_jax.generate import generate
from tiny import ByteTokenizer, tiny_model


@pytest.mark.parametrize("field, value, words", [
    ("max_new_tokens", 0, "positive integer"),
    ("max_new_tokens", 2.0, "positive integer"),
    ("max_new_tokens", True, "positive integer"),
    ("min_new_tokens", 9, "[0, max_new_tokens=8]"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", math.nan, ">= 0"),
    ("temperature", "0.7", ">= 0"),
    ("top_k", -1, ">= 0"),
    ("top_k", 1.5, "integer"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("seed", -1, "[0, 4294967295]"),
    ("seed", 2 ** 32, "[0, 4294967295]"),
    ("stop", ["x", ""], "non-empty"),
    ("stop", [3], "non-empty"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", ["2"], "token ids"),
    ("ignore_eos", "yes", "true or false"),
    ("n", 0, ">= 1"),
    ("logprobs", 1, "true or false"),
    ("top_logprobs", 21, "[0, 20]"),
    ("prompt_logprobs", 21, "[0, 20]"),
    ("prompt_logprobs", -1, "[0, 20]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", math.inf, "> 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("logit_bias", {"a": 1}, "token ids"),
    ("logit_bias", {-1: 1}, "token ids"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"),
    ("logit_bias", {5: math.nan}, "[-100, 100]"),
    ("logit_bias", {5: "1"}, "[-100, 100]"),
    ("logit_bias", {i: 1 for i in range(301)}, "at most 300"),
    ("logit_bias", [(1, 2), ("1", 3)], "twice"),
    ("logit_bias", "5=1", "map token ids"),
])
def test_each_bad_value_is_an_error_naming_its_field(field, value, words):
    with pytest.raises(ParamError) as e:
        GenerationParams(max_new_tokens=8, **{field: value}) if field != "max_new_tokens" else \
            GenerationParams(max_new_tokens=value)
    assert e.value.field == field and str(e.value).startswith(f"{field} ") and words in e.value.detail, str(e.value)
    assert isinstance(e.value, ValueError)


def test_rules_between_fields():
    with pytest.raises(ParamError, match="n 2 samples per prompt need temperature > 0"):
        GenerationParams(n=2)
    assert GenerationParams(n=2, temperature=0.5).n == 2
    with pytest.raises(ParamError, match="top_logprobs needs logprobs"):
        GenerationParams(top_logprobs=3)
    assert GenerationParams(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert GenerationParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0  # scores the prompt only
    with pytest.raises(ParamError, match=r"max_new_tokens must be a positive integer \(0 only with prompt_logprobs\)"):
        GenerationParams(max_new_tokens=0)


def test_values_are_normalized_and_derived():
    p = GenerationParams(max_new_tokens=5, stop="END", stop_token_ids=[7, 3], temperature=1, top_k=4,
                         repetition_penalty=1.2, presence_penalty=0.5)
    assert p.stop == ("END",) and p.stop_token_ids == (7, 3) and isinstance(p.temperature, float)
    assert p.sampling == SamplingParams(1.0, 4, 1.0) and p.penalties == Penalties(1.2, 0.5, 0.0)
    assert hash(p) == hash(GenerationParams(max_new_tokens=5, stop=("END",), stop_token_ids=(7, 3), temperature=1.0,
                                            top_k=4, repetition_penalty=1.2, presence_penalty=0.5))
    assert p.eos_ids((2, 3)) == (2, 3, 7) and p.replace(ignore_eos=True).eos_ids((2, 3)) == (3, 7)
    assert GenerationParams.of(SamplingParams(0.7, 0, 0.9), Penalties(1.1), max_new_tokens=3) == GenerationParams(
        max_new_tokens=3, temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    with pytest.raises(ParamError, match=r"stop_token_ids must be token ids in \[0, 5\), got \[7\]"):
        p.check_vocab(5)
    with pytest.raises(ParamError, match="temperature"):  # a copy is checked again
        p.replace(temperature=-1)
    b = GenerationParams(logit_bias={"50": 5, 3: -100})  # OpenAI's JSON keys are strings
    assert b.logit_bias == ((3, -100.0), (50, 5.0)) and b == GenerationParams(logit_bias=[(50, 5.0), (3, -100)])
    assert hash(b) == hash(b.replace()) and b.adjusts_logits and not GenerationParams().adjusts_logits
    assert GenerationParams(logit_bias={i: 1 for i in range(300)}).logit_bias[-1] == (299, 1.0)  # OpenAI's limit
    with pytest.raises(ParamError, match=r"logit_bias keys must be token ids in \[0, 40\), got \[50\]"):
        b.check_vocab(40)


def test_sampling_and_penalties_share_the_checks():
    with pytest.raises(ParamError, match="top_p must be in"):
        SamplingParams(0.5, 0, 0.0)
    with pytest.raises(ParamError, match="frequency_penalty must be a number in"):
        Penalties(1.0, 0.0, 9.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


def test_generate_takes_params_or_keywords_alike(model):
    tok = ByteTokenizer()
    p = GenerationParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=3, stop_token_ids=(5,), n=2)
    by_params = generate(model, tok, ["ab", "hello"], params=p, strategy="lookahead", decoding_length=4)
    by_kw = generate(model, tok, ["ab", "hello"], max_new_tokens=12, temperature=0.8, top_k=20, seed=3,
                     stop_token_ids=[5], n=2, strategy="lookahead", decoding_length=4)
    assert by_params.token_ids == by_kw.token_ids and len(by_params.rows) == 4
    with pytest.raises(ValueError, match="not both: max_new_tokens, temperature given beside params"):
        generate(model, tok, "ab", params=p, max_new_tokens=3, temperature=0.5)
    with pytest.raises(ValueError, match="params must be a GenerationParams"):
        generate(model, tok, "ab", params=dict(max_new_tokens=3))
    with pytest.raises(ParamError, match="stop_token_ids must be token ids in"):
        generate(model, tok, "ab", params=GenerationParams(max_new_tokens=3, stop_token_ids=(10 ** 6,)))
