"""The OpenAI-compatible request bodies (pydantic) and the error shape, as vLLM's server
names them: `n`, `stop`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`logprobs`, the penalties, `min_tokens`, `stop_token_ids`, `ignore_eos`.

Host only (no jax). Unknown fields are ignored, as OpenAI's API does; a wrong type or a
value out of range is a 400 with pydantic's message naming the field. The project's own
options ride in one extension field, `lookahead_jax` (the openai client sends it with
`extra_body={"lookahead_jax": {...}}`):

    {"strategy": "greedy"}                  # plain decoding on a speculative server
    {"references": ["text lookahead drafts from too", ...]}
    {"return_token_ids": true}              # also vLLM's top-level `return_token_ids`
    {"return_retrieval": true}              # ralm / ralmspec / knnlm servers: each choice's
                                            # `retrieval` record (passages used, counters)
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Extension(BaseModel):
    """The per-request `lookahead_jax` field."""

    model_config = ConfigDict(extra="forbid")
    strategy: Optional[str] = None  # the server's strategy (default) or "greedy"
    references: list[str] = Field(default_factory=list)
    return_token_ids: bool = False
    return_retrieval: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[dict] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 32)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    user: Optional[str] = None
    lookahead_jax: Extension = Field(default_factory=Extension)

    @model_validator(mode="after")
    def _stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return self

    @property
    def stops(self) -> tuple:
        return tuple([self.stop] if isinstance(self.stop, str) else (self.stop or []))

    @property
    def token_ids_wanted(self) -> bool:
        return self.return_token_ids or self.lookahead_jax.return_token_ids

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of
    token-id lists (each a prompt of its own; choices are numbered prompt * n + sample)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=1)
    echo: bool = False

    @model_validator(mode="after")
    def _prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    @property
    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=1)

    @property
    def prompts(self) -> list:
        return [[m.model_dump() for m in self.messages]]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
