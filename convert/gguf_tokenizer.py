"""`tokenizers` backends rebuilt from a GGUF's tokenizer metadata (llama.cpp's key names).

Two vocabulary kinds are supported, chosen by `tokenizer.ggml.model`:

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

`set_post_processor` (BOS/EOS around every encoded sequence) also serves HF directories.
Host-only module: imports tokenizers and numpy.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
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


def byte_level_pipeline(pre: str | None):
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


def ranked_merges(tokens: Sequence[str], vocab: Mapping[str, int], rank: Mapping[str, float]):
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


def build_byte_level(meta: Mapping[str, Any]) -> HFTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spell = byte_to_unicode()
    alphabet = set(spell.values())
    # Real byte-level tokens are already spelled in the byte alphabet; respell any other (a raw
    # space or non-ASCII in an added token) as the byte-level spelling of its UTF-8 bytes.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False,
    ))
    tok.normalizer, tok.pre_tokenizer = byte_level_pipeline(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok


def build_sentencepiece(meta: Mapping[str, Any], arch: str) -> HFTokenizer:
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
        merges = ranked_merges(tokens, vocab, rank)
    tok = HFTokenizer(models.BPE(
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


def add_typed_tokens(tok: HFTokenizer, tokens: Sequence[str], types, byte_level: bool) -> None:
    """CONTROL tokens -> special added tokens; USER_DEFINED -> plain added tokens (both matched
    whole in raw text). In a byte-level vocabulary a CONTROL token spelled outside the byte
    alphabet is a mislabel and is skipped (as transformers does)."""
    if types is None:
        return
    types = np.asarray(types)
    alphabet = set(byte_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i in np.flatnonzero(types == CONTROL)
        if alphabet is None or set(tokens[i]) <= alphabet
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i in np.flatnonzero(types == USER_DEFINED)
        if tokens[i] in vocab  # Gemma's "  " (respelled) is not: it comes from merges instead
    ]
    if user:
        tok.add_tokens(user)


def set_post_processor(tok: HFTokenizer, meta: Mapping[str, Any]) -> None:
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
