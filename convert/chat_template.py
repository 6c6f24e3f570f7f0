"""Chat templates: compiled and rendered as transformers does, and the end-of-turn tokens
they imply.

Chat templates are rendered with jinja2's ImmutableSandboxedEnvironment configured as
transformers does (trim_blocks, lstrip_blocks, loopcontrols, a `{% generation %}` tag, a
non-HTML-escaping `tojson`, `raise_exception`, `strftime_now`, a restricted `dict` and
`namespace`), with bos_token/eos_token/unk_token/pad_token... as template variables. What a
template sees passes through `plain_data` first (plain JSON-like values only).

Host-only module: imports numpy and (lazily) jinja2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import numpy as np

END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template and none was passed."""


def end_of_turn_ids(tok: Any, chat_template: str | None) -> list[int]:
    """Ids of the `END_OF_TURN_TOKENS` the template uses (tok: a `tokenizers.Tokenizer`)."""
    if not chat_template:
        return []
    ids = []
    for t in END_OF_TURN_TOKENS:
        i = tok.token_to_id(t)
        if i is not None and t in chat_template:
            ids.append(i)
    return ids


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str):
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


def plain_data(value: Any) -> Any:
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
        return plain_data(value.item())
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def prepare_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict]:
    """The messages as templates read them: plain data (`plain_data`), None values dropped,
    a reasoning text under each of `_REASONING_KEYS`' names templates use."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        m = plain_data({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:  # templates read it under different names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out
