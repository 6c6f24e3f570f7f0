"""Text <-> token ids for the packaged models, without torch or transformers.

A GGUF carries its tokenizer as metadata under llama.cpp's key names; we rebuild a
`tokenizers.Tokenizer` from it (the Rust library alone, which also loads a plain HF
`tokenizer.json`): `gguf_tokenizer.py` builds the vocabulary, pre-tokenizer and decoder
("gpt2" byte-level BPE: SmolLM2, Qwen2.5; "llama" sentencepiece BPE: Gemma-3).
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

Chat templates: `chat_template.py` (rendered as transformers does); streaming text:
`detokenizer.py` (`IncrementalDetokenizer`, through `Tokenizer.stream`).

Host-only module: imports tokenizers, numpy and (lazily) jinja2; never torch or transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from .chat_template import (END_OF_TURN_TOKENS, NoChatTemplateError, compile_chat_template, end_of_turn_ids,
                            plain_data, prepare_messages)
from .detokenizer import IncrementalDetokenizer
from .gguf_tokenizer import add_typed_tokens, build_byte_level, build_sentencepiece, set_post_processor

__all__ = [
    "Tokenizer",
    "IncrementalDetokenizer",
    "NoChatTemplateError",
    "read_gguf_metadata",
    "END_OF_TURN_TOKENS",
]

META_FILE = "lookahead_tokenizer.json"
_META_VERSION = 1

_SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, without touching tensor data.

    Numeric arrays come back as numpy arrays, string arrays as lists of str. One header
    parser serves the weights and the tokenizer (`gguf_weights.open_gguf`, ~0.2 s for
    Gemma-3's 262k-token vocabulary; gguf.GGUFReader takes ~10 s).
    """
    from .gguf_weights import open_gguf  # lazy: importing the tokenizer stays cheap

    return open_gguf(path).metadata


# --- the tokenizer ---------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model facts transformers keeps beside it.

    Build with `from_gguf`, `from_dir` (HF directory or one written by `save`) or `load`.
    """

    def __init__(self, backend: HFTokenizer, meta: Mapping[str, Any]):
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
            backend = build_byte_level(meta)
        elif kind == "llama":
            backend = build_sentencepiece(meta, arch)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' sentencepiece BPE)"
            )
        add_typed_tokens(backend, tokens, types, byte_level=kind == "gpt2")

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
        set_post_processor(backend, info)
        template = meta.get("tokenizer.chat_template")
        info["chat_template"] = template if isinstance(template, str) and template else None
        eos_ids = [info["eos_token_id"]] if "eos_token_id" in info else []
        for key in ("eot_token_id", "eom_token_id"):  # llama.cpp's explicit end-of-turn ids
            i = meta.get(f"tokenizer.ggml.{key}")
            if i is not None and 0 <= int(i) < len(tokens):
                eos_ids.append(int(i))
        eos_ids += end_of_turn_ids(backend, info["chat_template"])
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
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))

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
            set_post_processor(backend, info)
        else:  # tokenizer.json's post-processor decides; record what it does
            probe = backend.encode("a", add_special_tokens=True).ids
            plain = backend.encode("a", add_special_tokens=False).ids
            info["add_bos"] = len(probe) > len(plain) and probe[0] == info.get("bos_token_id")
            info["add_eos"] = len(probe) > len(plain) and probe[-1] == info.get("eos_token_id")
        info["clean_up_tokenization_spaces"] = bool(config.get("clean_up_tokenization_spaces", False))
        eos_ids = [info["eos_token_id"]] if "eos_token_id" in info else []
        gen_eos = gen.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        eos_ids += end_of_turn_ids(backend, template)
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
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), meta)

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
        variables = {**self.special_tokens_map, **plain_data(kwargs)}
        text = compile_chat_template(template).render(
            messages=prepare_messages(messages),
            tools=plain_data(tools),
            documents=plain_data(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
