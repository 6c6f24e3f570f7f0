"""Chat messages as OpenAI's clients send them, made into what the model's chat template
renders, and the check that it does render them.

* `content`: a string or a list of parts. Text parts are joined with a newline (as vLLM
  joins them); any other part (`image_url`, `input_audio`, `file`, `refusal`) is a 400
  naming it: this server serves text only.
* Role `developer` is the template's system turn.
* An assistant turn with `tool_calls` (its `content` may be null) and `tool` messages go
  to the template as Hugging Face templates take them (a call's `arguments` as an object
  when they are a JSON object, as vLLM hands them). `check_renders` refuses a conversation
  whose tool calls, tool results or `tools` the template drops (SmolLM2's renders `tool`
  messages as turns of their own but drops `tool_calls` and `tools`): a 400 saying the
  model's chat template cannot render them, rather than a prompt silently missing them.

Host only (no jax).
"""

from __future__ import annotations

import copy
import inspect
import json
import secrets
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON text, as the model wrote it


class ToolCall(BaseModel):
    """One entry of an assistant turn's `tool_calls`."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    """One entry of a request's `tools` (handed to the chat template as given)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(BaseModel):
    """One message of `messages`. `refusal`, `audio` and `function_call` are taken only as
    null (an assistant message echoed back from a response); anything else is refused."""

    model_config = ConfigDict(extra="forbid")
    role: Literal[ROLES]
    content: Optional[Union[str, list[dict]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    audio: Optional[dict] = None
    function_call: Optional[dict] = None

    @field_validator("content")
    @classmethod
    def _text(cls, content):
        """A list of parts becomes its text parts joined with newlines."""
        if not isinstance(content, list):
            return content
        if not content:
            raise ValueError("an empty list of content parts")
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part {k} is {'an' if str(kind)[:1] in 'aeiou' else 'a'} {kind!r} part: "
                                 "this server serves text only (parts of type 'text' are joined)")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f'content part {k}: a text part is {{"type": "text", "text": "..."}}, got {part!r}')
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("refusal", "audio", "function_call")
    @classmethod
    def _null(cls, value, info):
        if value is not None:
            why = {"refusal": "an assistant turn's refusal is not rendered: send it as content",
                   "audio": "this server serves text only", "function_call": "the deprecated function_call is "
                   "not served: send tool_calls"}[info.field_name]
            raise ValueError(f"only null is accepted ({why})")
        return value

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are part of an assistant turn, not of a {self.role!r} message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("'content' is required (null only on an assistant turn with tool_calls)")
        return self

    def template(self) -> dict:
        """The message as chat templates take it (module docstring)."""
        m = dict(role="system" if self.role == "developer" else self.role, content=self.content or "")
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [dict(id=c.id, type=c.type, function=dict(name=c.function.name,
                                                                         arguments=_arguments(c.function.arguments)))
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


def _arguments(text: str):
    """A call's arguments as an object when they are a JSON object (templates write them
    with `tojson`), else the text as the model wrote it."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class CannotRender(ValueError):
    """The model's chat template cannot render this conversation (`param`: the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_renders(tokenizer, messages: list, tools: Optional[list] = None) -> None:
    """Refuse (`CannotRender`) a conversation whose tool calls, tool results (`tool`
    messages) or `tools` the chat template does not render: they are rendered once with
    a unique mark in place of each call's name, each tool result and each tool's name,
    and every mark must be in the text. Nothing to check (no render) without them."""
    calls = [(i, j) for i, m in enumerate(messages) for j in range(len(m.get("tool_calls") or ()))]
    results = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    if not (calls or results or tools):
        return
    mark = "probe" + secrets.token_hex(4)
    probe = copy.deepcopy(messages)
    for k, (i, j) in enumerate(calls):
        probe[i]["tool_calls"][j]["function"]["name"] = f"{mark}c{k}x"
    for k, i in enumerate(results):
        probe[i]["content"] = f"{mark}r{k}x"
    probe_tools = copy.deepcopy(tools) or []
    for k, t in enumerate(probe_tools):
        t["function"]["name"] = f"{mark}t{k}x"
    if tools and not takes_tools(tokenizer):
        raise CannotRender("the model's chat template cannot render tools (its tokenizer takes none): leave "
                           "'tools' out", "tools")
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True,
                                             **({"tools": probe_tools} if tools else {}))
    except Exception as e:  # noqa: BLE001 - the template's own error (e.g. roles that must alternate)
        raise CannotRender(f"the model's chat template cannot render these messages: {e}", "messages") from None
    lost = [i for k, (i, _) in enumerate(calls) if f"{mark}c{k}x" not in text]
    if lost:
        raise CannotRender(f"the model's chat template cannot render tool calls: the tool_calls of message "
                           f"{lost[0]} are not in the prompt it renders", "messages")
    lost = [i for k, i in enumerate(results) if f"{mark}r{k}x" not in text]
    if lost:
        raise CannotRender(f"the model's chat template cannot render tool results: the 'tool' message "
                           f"{lost[0]} is not in the prompt it renders", "messages")
    if any(f"{mark}t{k}x" not in text for k in range(len(probe_tools))):
        raise CannotRender("the model's chat template cannot render tools: the tools are not in the prompt "
                           "it renders; leave 'tools' out", "tools")


def takes_tools(tokenizer) -> bool:
    """Its `apply_chat_template` takes `tools` (by name or as **kwargs)."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):  # no signature to read: try it
        return True
    return "tools" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class WithTools:
    """A tokenizer whose `apply_chat_template` renders `tools` too (for
    `prompts.encode_prompts`, which renders messages alone); anything else is the
    tokenizer's."""

    def __init__(self, tokenizer, tools: list):
        self._tokenizer, self._tools = tokenizer, tools

    def apply_chat_template(self, messages, **kw):
        return self._tokenizer.apply_chat_template(messages, tools=self._tools, **kw)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def template_tokenizer(tokenizer, messages: list, tools: Optional[list] = None):
    """`check_renders`, then the tokenizer to encode the messages with (`WithTools` when
    there are tools)."""
    check_renders(tokenizer, messages, tools)
    return WithTools(tokenizer, tools) if tools else tokenizer


def next_turn_ids(tokenizer, messages: list, answer: str) -> list:
    """The token ids the next turn's prompt of a chat begins with once `answer` is its
    assistant turn: the conversation is rendered twice, closed after the answer
    (add_generation_prompt=False) and with a next user turn after it (as the next
    request's prompt renders), each encoded as `prompts.encode_prompts` encodes a chat;
    the ids they share from the start (a template that renders the last assistant turn
    otherwise than an earlier one, or whose end of turn tokenizes differently before more
    text, shares less). A prefix-cache warm job forwards them (`Scheduler.warm`).

        SmolLM2: <|im_start|>system ... <|im_start|>assistant\\n{answer}<|im_end|>\\n
    """
    convo = list(messages) + [dict(role="assistant", content=answer)]
    closed = tokenizer.apply_chat_template(convo, add_generation_prompt=False)
    probe = tokenizer.apply_chat_template(convo + [dict(role="user", content="next")], add_generation_prompt=True)
    a = tokenizer.encode(closed, add_special_tokens=False)
    b = tokenizer.encode(probe, add_special_tokens=False)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return list(a[:n])
