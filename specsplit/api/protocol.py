"""The OpenAI request bodies the API accepts, and its error type. No torch, no sockets.

Requests are pydantic models that forbid unknown fields, so nothing a client sends is silently
ignored. Parameters the fleet cannot honour exactly (log-probabilities, penalties, logit bias,
tools, response formats, echo, best_of, suffix) are accepted only at the value that means "off"
(what OpenAI's SDKs send as defaults, e.g. ``frequency_penalty: 0``); any other value is a 400
naming the parameter. Every validation failure becomes ``ApiError`` (400), never a 422.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import SamplingSpec

MAX_TOP_K = SamplingSpec.model_fields["top_k"].metadata[-1].le  # what the fleet's SamplingSpec takes
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM more
MAX_STOP_CHARS = 1024
MAX_N = 16
MAX_MESSAGES = 4096
SEED_RANGE = (-(2**63), 2**64 - 1)

# parameter -> the values that mean "off" (accepted, honoured exactly by doing nothing)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class ApiError(Exception):
    """An error answered in OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # extension (vLLM's): -1 or 0 is off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's cache hint: requests with the same key (a conversation's turns) go to the same
    # workers, whose prefix caches hold what they share (Job.group)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    # accepted at their "off" value only (UNSUPPORTED)
    logprobs: Any = None
    top_logprobs: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name, off in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if not any(value == o and type(value) is type(o) or value is o for o in off):
                raise ApiError(400, f"{name} is not supported by this server (only {off[-1]!r} or absent)",
                               param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions: ``prompt`` is a string, a list of strings, a list of token ids, or a
    list of lists of token ids; each prompt gets ``n`` choices."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: system (or developer), user and assistant turns; text only."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None

    @model_validator(mode="after")
    def _one_budget(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_completion_tokens")
        return self

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def turns(self) -> list[dict[str, str]]:
        """The conversation for a chat template (a developer turn is a system turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def parse(cls: type[_Request], body: Any) -> _Request:
    """A validated request, or ApiError(400) naming the first offending parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ApiError:
        raise
    except ValidationError as exc:
        err = exc.errors()[0]
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ApiError):  # raised inside a validator
            raise inner from None
        loc = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown parameter {param!r}: not supported by this server"
            code = "unsupported_parameter"
        else:
            msg = f"{loc}: {msg}"
            code = None
        raise ApiError(400, msg, param=param, code=code) from None
