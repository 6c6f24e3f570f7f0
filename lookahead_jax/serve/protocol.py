"""The OpenAI-compatible request bodies (pydantic) and the error shape.

Every field of OpenAI's completion and chat completion requests is either applied or,
when sent with another value than its default, refused with a 400 naming it (`param`):
nothing is accepted and ignored. `logit_bias` is applied (its keys, token ids as
strings, and values are checked by `GenerationParams`). Refused, with what is not
served: `best_of` (other than `n`), `suffix`, `echo` with `stream`, `response_format` (other than
text), `tool_choice` other than "none" and `parallel_tool_calls` (tool calls are not
parsed from the output), `audio` / `modalities` beyond text, the deprecated `functions` /
`function_call`, `store`, `service_tier` (other than auto / default), `reasoning_effort`,
`verbosity`, `web_search_options`, `moderation`, `prompt_cache_options` /
`prompt_cache_retention`, `stream_options.include_obfuscation`. Taken as the labels
OpenAI defines them as (no effect on the output): `user`, `metadata`,
`safety_identifier`, `prompt_cache_key`. A field in neither OpenAI's nor vLLM's set this
server serves (`top_k`, `min_tokens`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `return_token_ids`, `stream_options.continuous_usage_stats`) is a 400 too
(unknown field). A wrong type is a 400 with pydantic's message naming the field; a value
out of range, one from `core.params.GenerationParams` (the one place every front end's
options are checked), naming the field as the request spells it (`field_name`). Chat messages: `chat.ChatMessage`.

The project's own options ride in one extension field, `lookahead_jax` (the openai client
sends it with `extra_body={"lookahead_jax": {...}}`):

    {"strategy": "greedy"}                  # plain decoding on a speculative server
    {"references": ["text lookahead drafts from too", ...]}
    {"return_token_ids": true}              # also vLLM's top-level `return_token_ids`
    {"return_retrieval": true}              # ralm / ralmspec / knnlm servers: each choice's
                                            # `retrieval` record (passages used, counters)

Host only (no jax).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.params import GenerationParams
from .chat import ChatMessage, Tool

TOOLS_NOT_PARSED = ("tool calls are not parsed from the model's output yet: send tool_choice \"none\" to have the "
                    "tools rendered into the prompt only")


def _null(v, _data) -> bool:
    return v is None


# field -> (accepted(value, the fields validated before it), why another value is refused)
NOT_SERVED = {
    "echo": (lambda v, d: not v or not d.get("stream"), "echo is served without stream: true (the prompt and its "
             "log-probabilities come whole with the answer)"),
    "suffix": (lambda v, _: not v, "suffix (text after the completion) is not supported"),
    "best_of": (lambda v, d: v is None or v == d.get("n", 1),
                "best_of other than n is not supported (no completions are generated to choose from)"),
    "response_format": (lambda v, _: v is None or v == {"type": "text"},
                        'structured output (json_object, json_schema) is not supported yet: only {"type": "text"}'),
    "tool_choice": (lambda v, d: v in ("none", None) and (v == "none" or not d.get("tools")), TOOLS_NOT_PARSED),
    "parallel_tool_calls": (_null, TOOLS_NOT_PARSED),
    "audio": (_null, "audio output is not served: this server answers with text only"),
    "modalities": (lambda v, _: v in (None, ["text"]), 'only the "text" modality is served'),
    "functions": (_null, "the deprecated functions are not served: send tools"),
    "function_call": (_null, "the deprecated function_call is not served: send tool_choice"),
    "store": (lambda v, _: not v, "stored completions are not served: this server stores nothing"),
    "service_tier": (lambda v, _: v in (None, "auto", "default"), 'only the "auto" / "default" tier is served'),
    "reasoning_effort": (_null, "reasoning effort is not controlled by this server"),
    "verbosity": (_null, "verbosity is not controlled by this server"),
    "web_search_options": (_null, "web search is not served"),
    "moderation": (_null, "moderation is not run by this server"),
    "prompt_cache_options": (_null, "prompt cache options are not served: this server keeps no prompt cache"),
    "prompt_cache_retention": (_null, "prompt cache retention is not served: this server keeps no prompt cache"),
    "include_obfuscation": (lambda v, _: not v, "stream obfuscation is not implemented: send false or leave it out"),
}


def _refuse(value, info):
    """The `NOT_SERVED` check of one field (a pydantic field validator's body)."""
    accepted, why = NOT_SERVED[info.field_name]
    if not accepted(value, info.data):
        raise ValueError(why)
    return value


class Extension(BaseModel):
    """The per-request `lookahead_jax` field."""

    model_config = ConfigDict(extra="forbid")
    strategy: Optional[str] = None  # the server's strategy (default) or "greedy"
    references: list[str] = Field(default_factory=list)
    return_token_ids: bool = False
    return_retrieval: bool = False


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` (a last chunk with the usage), vLLM's
    `continuous_usage_stats` (every chunk carries the usage so far)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    include_obfuscation: Optional[bool] = None

    _obfuscation = field_validator("include_obfuscation")(_refuse)


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    n: int = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    return_token_ids: bool = False
    user: Optional[str] = None  # a label (OpenAI: for abuse monitoring): no effect on the output
    logit_bias: Optional[dict[str, float]] = None  # {"token id": bias}, OpenAI's JSON keys
    lookahead_jax: Extension = Field(default_factory=Extension)

    @field_validator("n", mode="before")
    @classmethod
    def _one(cls, value):
        return 1 if value is None else value  # OpenAI's null: the default

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @property
    def stops(self) -> tuple:
        return tuple([self.stop] if isinstance(self.stop, str) else (self.stop or []))

    @property
    def prompt_logprobs_wanted(self) -> Optional[int]:
        return None

    def field_name(self, name: str) -> str:
        """This request's name of a `GenerationParams` field (for a `ParamError`)."""
        names = dict(max_new_tokens=getattr(self, "limit_field", "max_tokens"), min_new_tokens="min_tokens",
                     top_logprobs="logprobs" if isinstance(self, CompletionRequest) else "top_logprobs")
        return names.get(name, name)

    @property
    def token_ids_wanted(self) -> bool:
        return self.return_token_ids or self.lookahead_jax.return_token_ids

    @property
    def include_usage(self) -> bool:
        """A last chunk with the whole request's usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def params(self, max_new_tokens: int, seed: int) -> GenerationParams:
        """The request's `GenerationParams` (checked there: a `ParamError` names the
        field, `field_name` gives its name here), `max_new_tokens` and `seed` as the
        server settles them (the room left, a random seed); OpenAI's nulls are the
        defaults, and top_k -1 (vLLM) is off."""
        k = self.top_logprobs_wanted
        return GenerationParams(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k in (None, -1) else self.top_k, top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed, stop=self.stops, stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            n=self.n, logprobs=self.wants_logprobs, top_logprobs=k, prompt_logprobs=self.prompt_logprobs_wanted,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logit_bias=self.logit_bias or ())

    @property
    def references(self) -> list:
        """Texts lookahead drafts from besides the prompt (`lookahead_jax.references`)."""
        return list(self.lookahead_jax.references)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of
    token-id lists (each a prompt of its own; choices are numbered prompt * n + sample)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    _completion_not_served = field_validator("echo", "suffix", "best_of")(_refuse)

    @model_validator(mode="after")
    def _prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_logprobs_wanted(self) -> int:
        """Most likely alternatives per token (completions: `logprobs` k)."""
        return self.logprobs or 0

    @property
    def prompt_logprobs_wanted(self) -> Optional[int]:
        """`echo` with `logprobs` k: the prompt's log-probabilities and k alternatives (as
        lm-eval's loglikelihood asks); echo with max_tokens 0 scores the prompt too."""
        if not self.echo:
            return None
        return self.logprobs if self.logprobs is not None else (0 if self.max_tokens == 0 else None)


class Prediction(BaseModel):
    """`prediction` (OpenAI's predicted output): text the answer is expected to repeat,
    which lookahead drafts from (a reference, as `lookahead_jax.references`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: Union[str, list[dict]]

    @field_validator("content")
    @classmethod
    def _text(cls, content):
        if isinstance(content, list):
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                raise ValueError('prediction content parts must be {"type": "text", "text": "..."}')
            return "".join(p["text"] for p in content)
        return content


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None  # rendered by the chat template, where it can (`chat.check_renders`)
    tool_choice: Any = Field(None, validate_default=True)
    prediction: Optional[Prediction] = None
    # labels (OpenAI: for dashboards, abuse monitoring, cache routing): no effect on the output
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    # refused at any other value than their default (NOT_SERVED)
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    _chat_not_served = field_validator(
        "tool_choice", "parallel_tool_calls", "response_format", "audio", "modalities", "functions",
        "function_call", "store", "service_tier", "reasoning_effort", "verbosity", "web_search_options",
        "moderation", "prompt_cache_options", "prompt_cache_retention")(_refuse)

    @property
    def prompts(self) -> list:
        return [self.template_messages]

    @property
    def template_messages(self) -> list:
        """The messages as the chat template takes them (`chat.ChatMessage.template`)."""
        return [m.template() for m in self.messages]

    @property
    def template_tools(self) -> Optional[list]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def references(self) -> list:
        return super().references + ([self.prediction.content] if self.prediction and self.prediction.content
                                     else [])

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def top_logprobs_wanted(self) -> int:
        return self.top_logprobs or 0

    @property
    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Tool]] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int]


KINDS = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
         429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    kind = KINDS.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
