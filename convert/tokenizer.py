"""Text <-> token ids for the packaged models, without torch or transformers.

A GGUF carries its tokenizer as metadata under llama.cpp's key names; we rebuild a
`tokenizers.Tokenizer` from it (the Rust library alone, which also loads a plain HF
`tokenizer.json`). Two vocabulary kinds are supported, chosen by `tokenizer.ggml.model`:

* "gpt2": byte-level BPE (SmolLM2, Qwen2.5). Vocabulary and merges are stored; the text is
  split before BPE by a regex named in `tokenizer.ggml.pre`:
    smollm / starcoder / refact / codeshell: every digit alone, then the GPT-2 regex
        (llama.cpp's rule, and the `Digits(individual_digits=True)` + `ByteLevel` of
        SmolLM2's own tokenizer.json). transformers 5.23 does not know "smollm" and uses the
        GPT-2 regex alone; the two differ only next to numeric characters, where GPT-2's
        " ?\\p{N}+" takes a space along: "a  1" is ours [a, "  ", 1] (the model's) and
        transformers' [a, " ", " ", 1]; " ½" ours [" ", ½], transformers' [" ½"]. See tests.
    qwen2 / deepseek-r1-qwen: NFC, then Qwen2's regex (single digits, letter runs with one
        leading non-letter, ...) -- as Qwen2's tokenizer.json (transformers' GGUF path omits
        the NFC normalizer, which only matters for text that is not already NFC).
    llama-bpe / llama3: the Llama-3 regex.  default / gpt2 / unknown: the GPT-2 regex.
* "llama": sentencepiece-style BPE with byte fallback (Gemma-3). No merges are stored, so they
  are recovered from the vocabulary: every split of a token into two tokens is a merge, ranked
  by the token's score (for the gemma architectures: by the token's position in the file, as
  transformers does -- Gemma's scores do not follow its merge order). Gemma files spell
  whitespace-only tokens with real spaces; they are respelled with U+2581 first.

Token types: CONTROL (3) tokens become special added tokens and USER_DEFINED (4) ones plain
added tokens, so text such as "<|im_end|>" or "\\n\\n" in Gemma is matched whole, never split.
BOS/EOS are added by `encode(..., add_special_tokens=True)` exactly when the file says so
(`tokenizer.ggml.add_bos_token`, default True for "llama" vocabularies like llama.cpp).

`eos_token_ids` (the ids that stop generation) = the EOS id, plus the end-of-turn token of the
chat template when the template uses one of `END_OF_TURN_TOKENS` (<|im_end|>, <end_of_turn>,
<|eot_id|>, <|end|>), plus llama.cpp's `tokenizer.ggml.eot_token_id`/`eom_token_id` when a GGUF
has them, plus, for a HF directory, the ids in generation_config.json. A GGUF has no
generation_config, so a template-less base model (Gemma-3-270M) stops on <eos> only, and
SmolLM2-Instruct on <|im_end|> only (its EOS and its end of turn; <|endoftext|> is not added).
llama.cpp is more eager (any known end-of-generation text in the vocabulary); we keep the set
small so that "stop" means the same for our decoder and for a HF reference run.

Chat templates are rendered with jinja2's ImmutableSandboxedEnvironment configured as
transformers does (trim_blocks, lstrip_blocks, loopcontrols, a `{% generation %}` tag, a
non-HTML-escaping `tojson`, `raise_exception`, `strftime_now`, a restricted `dict` and
`namespace`), with bos_token/eos_token/unk_token/pad_token... as template variables.

Host-only module: imports tokenizers, numpy and (lazily) jinja2; never torch or transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "Tokenizer",
    "IncrementalDetokenizer",
    "NoChatTemplateError",
    "read_gguf_metadata",
    "END_OF_TURN_TOKENS",
]

META_FILE = "lookahead_tokenizer.json"
_META_VERSION = 1

END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template and none was passed."""


# --- GGUF metadata ---------------------------------------------------------------------------

def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, without touching tensor data.

    Numeric arrays come back as numpy arrays, string arrays as lists of str. One header
    parser serves the weights and the tokenizer (`gguf_weights.open_gguf`, ~0.2 s for
    Gemma-3's 262k-token vocabulary; gguf.GGUFReader takes ~10 s).
    """
    from .gguf_weights import open_gguf  # lazy: importing the tokenizer stays cheap

    return open_gguf(path).metadata


# --- building tokenizers from GGUF metadata --------------------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable bytes map to themselves,
    the other 68 to U+0100...). Byte-level vocabularies are spelled in these characters."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pipeline(pre: str | None):
    """(normalizer, pre_tokenizer) for a byte-level vocabulary and its `tokenizer.ggml.pre`."""

    def split(regex: str):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        digits = pre_tokenizers.Digits(individual_digits=True)
        return None, pre_tokenizers.Sequence([digits, gpt2])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return normalizers.NFC(), split(_QWEN2_SPLIT)
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return None, split(_LLAMA3_SPLIT)
    if pre not in (None, "default", "gpt2"):
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 regex", stacklevel=3)
    return None, gpt2


def _ranked_merges(tokens: Sequence[str], vocab: Mapping[str, int], rank: Mapping[str, float]):
    """Merges implied by a vocabulary without stored merges (sentencepiece-style BPE).

    Every way to cut a token into two tokens is a merge; merges are ordered by the token's rank
    (higher first), then longer left piece, then longer right piece, then vocabulary order.
    Same order as transformers' `generate_merges(vocab, rank)`:
        tokens [a, b, ab, abc], rank = -position -> merges [(a, b), (ab, c)]  (no "bc" token)
    Ties in rank keep vocabulary order.
    """
    found = []  # (-rank, -len(left), -len(right), seq, left, right)
    for tok, score in rank.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -cut, cut - len(tok), len(found), left, right))
    found.sort(key=lambda m: m[:4])
    return [(m[4], m[5]) for m in found]


def _build_byte_level(meta: Mapping[str, Any]) -> _HFTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spell = _byte_to_unicode()
    alphabet = set(spell.values())
    # Real byte-level tokens are already spelled in the byte alphabet; respell any other (a raw
    # space or non-ASCII in an added token) as the byte-level spelling of its UTF-8 bytes.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = _HFTokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False,
    ))
    tok.normalizer, tok.pre_tokenizer = _byte_level_pipeline(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _build_sentencepiece(meta: Mapping[str, Any], arch: str) -> _HFTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    if arch.startswith("gemma"):
        # Whitespace-only tokens of 2+ spaces are stored with real spaces; the model reads spaces
        # as U+2581, so respell them. Rank merges by file position (see module docstring).
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("sentencepiece GGUF without tokenizer.ggml.scores")
        rank = dict(zip(tokens, scores.tolist()))
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _ranked_merges(tokens, vocab, rank)
    tok = _HFTokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True, byte_fallback=True,
    ))
    if arch.startswith("gemma"):  # Gemma: spaces become U+2581, no prefix space
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:  # Llama-2 style: Metaspace, optional prefix space stripped again on decode
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        tok.decoder = decoders.Sequence(steps)
    return tok


def _add_typed_tokens(tok: _HFTokenizer, tokens: Sequence[str], types, byte_level: bool) -> None:
    """CONTROL tokens -> special added tokens; USER_DEFINED -> plain added tokens (both matched
    whole in raw text). In a byte-level vocabulary a CONTROL token spelled outside the byte
    alphabet is a mislabel and is skipped (as transformers does)."""
    if types is None:
        return
    types = np.asarray(types)
    alphabet = set(_byte_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i in np.flatnonzero(types == _CONTROL)
        if alphabet is None or set(tokens[i]) <= alphabet
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i in np.flatnonzero(types == _USER_DEFINED)
        if tokens[i] in vocab  # Gemma's "  " (respelled) is not: it comes from merges instead
    ]
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok: _HFTokenizer, meta: Mapping[str, Any]) -> None:
    """BOS/EOS around every encoded sequence, as the file's add_bos/add_eos flags say."""
    bos, eos = meta.get("bos_token"), meta.get("eos_token")
    add_bos = bool(meta.get("add_bos")) and bos is not None
    add_eos = bool(meta.get("add_eos")) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = []
    if add_bos:
        special.append((bos, meta["bos_token_id"]))
    if add_eos and (not add_bos or eos != bos):
        special.append((eos, meta["eos_token_id"]))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _end_of_turn_ids(tok: _HFTokenizer, chat_template: str | None) -> list[int]:
    if not chat_template:
        return []
    ids = []
    for t in END_OF_TURN_TOKENS:
        i = tok.token_to_id(t)
        if i is not None and t in chat_template:
            ids.append(i)
    return ids


# --- chat templates --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    """The template compiled in a sandbox configured like transformers' (see module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); have {jinja2.__version__}")

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        transformers; here it only renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render", [])
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """`dict(...)` for templates without exposing the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore-prefixed attribute names."""

        def __init__(*args, **kwargs):  # noqa: N805 -- same trick as jinja's Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                TemplateNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            TemplateNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {key!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like data, so the sandboxed template sees no foreign objects
    (their methods are not vetted by the sandbox); anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (str/int enums, ...) can carry methods: strip them to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:  # templates read it under different names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# --- the tokenizer ---------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model facts transformers keeps beside it.

    Build with `from_gguf`, `from_dir` (HF directory or one written by `save`) or `load`.
    """

    def __init__(self, backend: _HFTokenizer, meta: Mapping[str, Any]):
        self.backend = backend
        self._meta = dict(meta)
        self.chat_template: str | None = self._meta.get("chat_template")
        eos = self._meta.get("eos_token_ids")
        if eos is None:
            eos = [self._meta["eos_token_id"]] if self._meta.get("eos_token_id") is not None else []
        self._eos_ids = frozenset(int(i) for i in eos)

    # -- constructors --

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
                  ) -> "Tokenizer":
        """Build from a GGUF's metadata. With `cache_dir`, reuse a tokenizer saved there for the
        same file (path, size, mtime) or build and save one (Gemma-3: ~2 s to build, ~1 s to load)."""
        path = Path(path)
        st = path.stat()
        source = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if cache_dir is not None:
            try:
                cached = cls.load(cache_dir)
                if cached._meta.get("source") == source:
                    return cached
            except Exception:  # missing or unreadable cache: rebuild it
                pass
        tok = cls._build_from_gguf(read_gguf_metadata(path), source)
        if cache_dir is not None:
            tok.save(cache_dir)
        return tok

    @classmethod
    def _build_from_gguf(cls, meta: Mapping[str, Any], source: Any = None) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF has no tokenizer.ggml.tokens: no tokenizer to build")
        arch = str(meta.get("general.architecture", ""))
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type")
        if kind == "gpt2":
            backend = _build_byte_level(meta)
        elif kind == "llama":
            backend = _build_sentencepiece(meta, arch)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' sentencepiece BPE)"
            )
        _add_typed_tokens(backend, tokens, types, byte_level=kind == "gpt2")

        info: dict[str, Any] = {"format": _META_VERSION, "source": source, "gguf_model": kind,
                                "gguf_pre": meta.get("tokenizer.ggml.pre"), "arch": arch}
        gguf_keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                     "sep": "seperator_token_id", "pad": "padding_token_id",
                     "cls": "cls_token_id", "mask": "mask_token_id"}
        named = []
        for name, key in gguf_keys.items():
            i = meta.get(f"tokenizer.ggml.{key}")
            if i is not None and 0 <= int(i) < len(tokens):
                info[f"{name}_token_id"] = int(i)
                info[f"{name}_token"] = backend.id_to_token(int(i))
                named.append(info[f"{name}_token"])
        # named specials are special even if the file typed them otherwise (transformers too)
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])
        info["add_bos"] = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        info["add_eos"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, info)
        template = meta.get("tokenizer.chat_template")
        info["chat_template"] = template if isinstance(template, str) and template else None
        eos_ids = [info["eos_token_id"]] if "eos_token_id" in info else []
        for key in ("eot_token_id", "eom_token_id"):  # llama.cpp's explicit end-of-turn ids
            i = meta.get(f"tokenizer.ggml.{key}")
            if i is not None and 0 <= int(i) < len(tokens):
                eos_ids.append(int(i))
        eos_ids += _end_of_turn_ids(backend, info["chat_template"])
        info["eos_token_ids"] = sorted(set(eos_ids))
        return cls(backend, info)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a directory holding tokenizer.json: one written by `save`, or a HF model
        directory (tokenizer_config.json, special_tokens_map.json, generation_config.json,
        chat_template.jinja are read when present)."""
        path = Path(path)
        if (path / META_FILE).is_file():
            return cls.load(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))

        def read_json(name: str) -> dict:
            f = path / name
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

        config = read_json("tokenizer_config.json")
        special_map = read_json("special_tokens_map.json")
        gen = read_json("generation_config.json")
        info: dict[str, Any] = {"format": _META_VERSION, "source": {"path": str(path.resolve())}}
        for name in _SPECIAL_NAMES:
            value = config.get(f"{name}_token", special_map.get(f"{name}_token"))
            if isinstance(value, Mapping):  # serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                i = backend.token_to_id(value)
                if i is not None:
                    info[f"{name}_token"], info[f"{name}_token_id"] = value, i
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name":..., "template":...}]
            by_name = {t["name"]: t["template"] for t in config["chat_template"]}
            template = by_name.get("default")
        info["chat_template"] = template
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            info["add_bos"] = bool(config.get("add_bos_token", False))
            info["add_eos"] = bool(config.get("add_eos_token", False))
            _set_post_processor(backend, info)
        else:  # tokenizer.json's post-processor decides; record what it does
            probe = backend.encode("a", add_special_tokens=True).ids
            plain = backend.encode("a", add_special_tokens=False).ids
            info["add_bos"] = len(probe) > len(plain) and probe[0] == info.get("bos_token_id")
            info["add_eos"] = len(probe) > len(plain) and probe[-1] == info.get("eos_token_id")
        info["clean_up_tokenization_spaces"] = bool(config.get("clean_up_tokenization_spaces", False))
        eos_ids = [info["eos_token_id"]] if "eos_token_id" in info else []
        gen_eos = gen.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        eos_ids += _end_of_turn_ids(backend, template)
        info["eos_token_ids"] = sorted({int(i) for i in eos_ids})
        return cls(backend, info)

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json + lookahead_tokenizer.json (our metadata) into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f"tokenizer.json.{os.getpid()}.tmp"
        self.backend.save(str(tmp))
        os.replace(tmp, path / "tokenizer.json")
        meta = {**self._meta, "chat_template": self.chat_template,
                "eos_token_ids": sorted(self._eos_ids)}
        tmp = path / f"{META_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path / META_FILE)  # written last: its presence marks a complete save
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load what `save` wrote."""
        path = Path(path)
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != _META_VERSION:
            raise ValueError(f"{path / META_FILE}: format {meta.get('format')}, need {_META_VERSION}")
        return cls(_HFTokenizer.from_file(str(path / "tokenizer.json")), meta)

    # -- properties --

    @property
    def bos_token_id(self) -> int | None:
        return self._meta.get("bos_token_id")

    @property
    def eos_token_id(self) -> int | None:
        """The single EOS id of the vocabulary (see `eos_token_ids` for stopping)."""
        return self._meta.get("eos_token_id")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS + the template's end-of-turn token (module docstring)."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._meta.get("pad_token_id")

    @property
    def unk_token_id(self) -> int | None:
        return self._meta.get("unk_token_id")

    @property
    def add_bos_token(self) -> bool:
        return bool(self._meta.get("add_bos"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (added tokens included). The model's embedding
        table may have more rows (Qwen2.5: 151,936 rows, fewer tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """{"bos_token": "<bos>", ...}: the named special tokens, as chat templates see them."""
        return {f"{n}_token": self._meta[f"{n}_token"] for n in _SPECIAL_NAMES
                if self._meta.get(f"{n}_token") is not None}

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self._eos_ids)}, add_bos={self.add_bos_token}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # -- encode / decode --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config says
        (SmolLM2: none, Gemma-3: BOS). Special tokens written in the text are matched whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._meta.get("clean_up_tokenization_spaces") and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)  # WordPiece-era cleanup; never for BPE
        return text

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        """HF's name for `decode_batch` (`tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)`)."""
        return self.decode_batch(sequences, skip_special_tokens)

    def __call__(self, text, add_special_tokens: bool = True, **kwargs) -> dict:
        """HF-style call: {"input_ids": ids} for a str, or a list of id lists for a list of
        strs (no padding, no tensors: `return_tensors`, `padding` and the like are errors)."""
        if kwargs:
            raise TypeError(f"Tokenizer() takes text and add_special_tokens only, got {sorted(kwargs)}")
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": self.encode_batch(list(text), add_special_tokens)}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def stream(self, prompt_len: int = 0, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        """An `IncrementalDetokenizer` for streaming generated text (see its docstring)."""
        return IncrementalDetokenizer(self, prompt_len=prompt_len, skip_special_tokens=skip_special_tokens)

    # -- chat --

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        Same result as transformers' `apply_chat_template(messages, add_generation_prompt=...,
        tokenize=False)` (note our default add_generation_prompt=True). With `tokenize=True`
        returns ids encoded with add_special_tokens=False (the template writes any BOS itself).
        Extra kwargs become template variables. Raises NoChatTemplateError if the model has no
        template and `chat_template` is not given.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise NoChatTemplateError(
                "this tokenizer has no chat template (the GGUF has no tokenizer.chat_template; base "
                "models like Gemma-3-270M ship none). Pass chat_template=..., or encode plain text."
            )
        if isinstance(messages, Mapping) or not len(messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        variables = {**self.special_tokens_map, **_plain(kwargs)}
        text = _compile_chat_template(template).render(
            messages=_prepare_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class IncrementalDetokenizer:
    """Streams text while tokens arrive, never emitting a partial UTF-8 character.

        det = tok.stream(prompt_len=len(prompt_ids))
        for ...:  ids.append(next_id); print(det.step(ids), end="")
        print(det.flush())

    `step(ids)` takes all ids so far (prompt included; the first `prompt_len` are never
    emitted) and returns the new printable text. It decodes a short window
    ids[prefix:] and compares it with ids[prefix:read] (the text already emitted plus a few
    tokens of context), so decoders that drop a leading space still produce the right text:
        ids [p0 p1 | t0 t1 t2],  prefix=0, read=2  ->  emit decode(p0..t2)[len(decode(p0 p1)):]
    Text ending in U+FFFD (an incomplete UTF-8 sequence: a byte token or a byte-level token
    that cuts a character) is held back until later tokens complete it; `flush()` emits
    whatever is left (then a real invalid byte shows as U+FFFD). The concatenation of all
    returns equals decode(ids[prompt_len:]) for concatenative decoders (byte-level, Gemma).
    """

    _CONTEXT = 5  # tokens of prompt decoded with the first new token

    def __init__(self, tokenizer: Tokenizer, prompt_len: int = 0, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._prefix = max(0, prompt_len - self._CONTEXT)
        self._read = prompt_len
        self._ids: list[int] = []

    def _texts(self, ids: Sequence[int]) -> tuple[str, str]:
        before = self._tok.decode(ids[self._prefix : self._read], self._skip)
        return before, self._tok.decode(ids[self._prefix :], self._skip)

    def step(self, ids: Sequence[int]) -> str:
        self._ids = list(ids)
        if len(self._ids) <= self._read:
            return ""
        before, text = self._texts(self._ids)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    __call__ = step

    def flush(self) -> str:
        """The held-back rest (possibly ending in U+FFFD); the stream is then at its end."""
        if len(self._ids) <= self._read:
            return ""
        before, text = self._texts(self._ids)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]
