"""Prompts as token ids: plain text, chat messages (the model's chat template) or ids.

`encode_prompts` also finds each prompt's question span (for retrieval-augmented
strategies, whose queries are the question and whose passage goes right before it).
Host only: needs the tokenizer, no jax.
"""

from __future__ import annotations

import numpy as np

CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages, where: str = "messages") -> None:
    """Chat messages must be a non-empty list of {"role": one of CHAT_ROLES, "content":
    str}; anything else is a ValueError naming the message and the expected form (rather
    than a template engine's error, or a plain string taken as a prompt)."""
    form = 'a list of {"role": "user", "content": "..."} objects'
    if isinstance(messages, list) and not messages:
        raise ValueError(f"{where}: chat messages must be {form}, got an empty list")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: chat messages must be {form}, got {type(messages).__name__}"
                         + (" (for plain text use 'prompt')" if isinstance(messages, str) else ""))
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}, message {j}: must be an object like {{\"role\": \"user\", "
                             f"\"content\": \"...\"}}, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}, message {j}: 'role' must be one of {', '.join(CHAT_ROLES)}, "
                             f"got {role!r}" if "role" in m else f"{where}, message {j}: no 'role' field")
        if not isinstance(content, str):
            raise ValueError(f"{where}, message {j} ({role}): 'content' must be a string, got "
                             + (type(content).__name__ if "content" in m else "nothing (no 'content' field)"))


def encode_prompts(tokenizer, prompts, chat: bool, first_index: int = 0, spans: bool = False):
    """Prompts as token-id lists. A prompt is a str, a list of chat messages, or token ids.

    Errors name prompts by `first_index + position`. `spans=True` also returns, per prompt,
    the token span [start, end) of its question: the text of a plain prompt (after a BOS the
    tokenizer added), the last user message of a chat prompt (the template's tokens around it
    excluded; the whole prompt when the template's tokens do not split cleanly there)."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
    ):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    out, where = [], []
    own_bos = spans and adds_bos(tokenizer)
    for i, p in enumerate(prompts, first_index):
        content = None
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
                content = p
            else:
                ids = tokenizer.encode(p)
        elif isinstance(p, list) and p and isinstance(p[0], dict):
            check_messages(p, f"prompt {i}")
            text = tokenizer.apply_chat_template(p, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            users = [m["content"] for m in p if m["role"] == "user" and m["content"]]
            content = users[-1] if users else None
        elif isinstance(p, (list, tuple, np.ndarray)) and len(p) and all(
            isinstance(t, (int, np.integer)) for t in p
        ):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is empty or not a str / chat messages / token ids")
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens")
        out.append(ids)
        if spans:
            where.append(question_span(tokenizer, ids, own_bos, text if content is not None else None, content))
    return (out, where) if spans else out


def adds_bos(tokenizer) -> bool:
    """The tokenizer's `encode` puts a BOS token first (SmolLM2's bos_token_id, <|im_start|>,
    is not one it adds)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer.encode("a")
    return bool(probe) and probe[0] == bos and tokenizer.encode("a", add_special_tokens=False)[:1] != [bos]


def question_span(tokenizer, ids, own_bos: bool, text=None, content=None) -> tuple:
    """(start, end) of the question in `ids` (encode_prompts); `own_bos`: `adds_bos`."""
    start = 1 if own_bos and len(ids) > 1 and ids[0] == tokenizer.bos_token_id else 0
    if content is None:
        return start, len(ids)
    off = text.rfind(content)
    if off < 0:
        return start, len(ids)
    pre = tokenizer.encode(text[:off], add_special_tokens=False) if off else []
    post = text[off + len(content):]
    post = tokenizer.encode(post, add_special_tokens=False) if post else []
    a, b = len(pre), len(ids) - len(post)
    if ids[:a] == list(pre) and ids[b:] == list(post) and a < b:
        return a, b
    return start, len(ids)
