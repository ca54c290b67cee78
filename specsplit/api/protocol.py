"""The OpenAI request bodies the API accepts, and its error type. No torch, no sockets.

Requests are pydantic models that forbid unknown fields, so nothing a client sends is silently
ignored. Parameters the fleet cannot honour exactly (the deprecated ``functions``, best_of)
are accepted only at the value that means "off" (what OpenAI's SDKs send as defaults,
e.g. ``best_of: 1``); any other value is a 400 naming the parameter. Tools, tool choices and the
messages of a tool call are typed here (``specsplit.api.tools`` renders and parses them), and so
is ``response_format``: a JSON schema (or any JSON object) the target holds the output to
(``grammar``), and vLLM's structured outputs (``specsplit.api.structured``); ``logprobs`` per
endpoint (``logprobs_asked``); a completion's ``echo`` (the prompt's log-probabilities with
``logprobs``: ``prompt_logprobs_asked``) and ``suffix`` (fill in the middle). Every validation
failure becomes ``ApiError`` (400), never a 422.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import GrammarSpec, SamplingSpec
from schemas.messages import (
    MAX_CONTEXT_TOKENS, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, TokenBias,
)
from specsplit.api.errors import ApiError  # (re-exported: the API's modules import it from here)
from specsplit.grammar_text import grammar_error

MAX_TOP_K = SamplingSpec.model_fields["top_k"].metadata[-1].le  # what the fleet's SamplingSpec takes
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM more
MAX_STOP_CHARS = 1024
MAX_N = 16
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_CHOICES = 1024  # vLLM's structured_outputs.choice
# apply_chat_template's own arguments and what the server puts in the template: no client's variables
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "bos_token", "eos_token", "pad_token",
    "unk_token"})
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,128}$"  # OpenAI's characters; Anthropic's length (MCP tools' long names)
SEED_RANGE = (-(2**63), 2**64 - 1)

# parameter -> the values that mean "off" (accepted, honoured exactly by doing nothing)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=65536)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # honoured either way: the output is held to the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (``specsplit.api.structured``): one of json (a JSON schema, or
    its text), regex, choice, grammar (Lark or GBNF), json_object; JSON's whitespace and extra
    properties as vLLM shapes them. ``disable_fallback`` changes nothing (one engine, no other to
    fall back to); ``structural_tag`` is accepted only absent."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = Field(default=None, min_length=1, max_length=1024)
    disable_fallback: bool = False
    structural_tag: None = None


def schema_error(text: str) -> str:
    """Why the grammar engine (llguidance: no torch, a Rust wheel) cannot enforce a JSON
    schema's text; "" when it can."""
    return grammar_error("json_schema", text)


def grammar_of(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """The constraint a response format puts on the output (None: text); a 400 naming
    ``response_format`` when its schema is not one the grammar engine takes."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: Any = {"type": "object"}
    else:
        schema = fmt.json_schema.json_schema if fmt.json_schema.json_schema is not None else {}
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"the schema is over {MAX_GRAMMAR_CHARS} characters", param="response_format")
    error = schema_error(text)
    if error:
        raise ApiError(400, f"the JSON schema cannot be enforced: {error[:300]}", param="response_format")
    return GrammarSpec(kind="json_schema", text=text)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # extension (vLLM's): -1 or 0 is off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM's, llama.cpp's): 0 is off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's cache hint: requests with the same key (a conversation's turns) go to the same
    # workers, whose prefix caches hold what they share (Job.group)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    # the output's log-probabilities: typed per endpoint (``logprobs_asked``)
    logprobs: Any = None
    top_logprobs: Any = None
    # vLLM's penalties (OpenAI's two, and repetition_penalty, vLLM's extension): the target's
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    # OpenAI's: token id (a string) -> a bias added to its logit, -100 to 100 (the ids are checked
    # against the served tokenizer when the request is planned: ``logit_bias_for``)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: the end tokens do not end the answer (only max_tokens and stop strings do), as
    # serving benchmarks ask for fixed lengths; no end token among the first min_tokens tokens
    # (and no stop string ending in their text)
    ignore_eos: bool = Field(default=False, strict=True)
    min_tokens: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS)
    # vLLM's: the answer's text ends after the stop string that ended it, not before
    include_stop_str_in_output: bool = Field(default=False, strict=True)
    # vLLM's: more token ids that end the answer (included in it; their text too unless special)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS // 2)
    # accepted at their "off" value only (UNSUPPORTED)
    response_format: ResponseFormat | None = None  # the output held to JSON (grammar_of)
    # vLLM's constraints on the output, and those of vLLM before 0.12 (specsplit.api.structured)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_whitespace_pattern: str | None = Field(default=None, min_length=1, max_length=1024)
    # which of vLLM's engines enforces them: here always llguidance (vLLM's "guidance"), whatever is named
    guided_decoding_backend: str | None = Field(default=None, max_length=64)
    # SGLang's constraints: a JSON schema's text, a regex, an EBNF (GBNF) grammar
    json_schema: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    ebnf: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    # llama.cpp's sampler chain, as clients of llama-server send it here too (llama.vscode's chat
    # edits): which samplers act and whether the temperature comes last (api.llama_fields)
    samplers: list[str] | str | None = Field(default=None, max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _llama_fields(cls, data):
        """llama.cpp's other fields (api.llama_fields): those that change nothing here dropped,
        those honoured only when off checked (a 400 naming one that is not); its ``max_tokens: -1``
        is no limit."""
        if not isinstance(data, dict):
            return data
        from specsplit.api.llama_fields import IGNORED, OFF_ONLY, check_fields

        theirs = {k: v for k, v in data.items() if k not in cls.model_fields and (k in IGNORED or k in OFF_ONLY)}
        if not theirs and data.get("max_tokens") != -1:
            return data
        check_fields(theirs)
        data = {k: v for k, v in data.items() if k not in theirs}
        if data.get("max_tokens") == -1 and type(data["max_tokens"]) is int:
            data["max_tokens"] = None
        return data

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
        self.logprobs_asked  # noqa: B018  (a 400 naming the parameter when malformed)
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


def logit_bias_for(req, vocab_size: int) -> list[TokenBias] | None:
    """The request's ``logit_bias`` for the wire; a 400 naming it for a key that is no token id of
    the served tokenizer or a bias outside -100..100."""
    if not req.logit_bias:
        return None
    out = []
    for key, bias in req.logit_bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: {key[:20]!r} is no token id of this model (0 to {vocab_size - 1})",
                           param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise ApiError(400, f"logit_bias: the bias of {key} is outside -100 to 100", param="logit_bias")
        out.append(TokenBias(token_id=int(key), bias=float(bias)))
    return out


def _top_count(value: Any, param: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be an integer from 0 to {MAX_TOP_LOGPROBS}", param=param)
    return value


class CompletionRequest(_Request):
    """POST /v1/completions: ``prompt`` is a string, a list of strings, a list of token ids, or a
    list of lists of token ids; each prompt gets ``n`` choices. ``logprobs``: how many of the most
    likely tokens to list beside each token's log-probability (off: absent, null or false)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 only with echo
    # the prompt before each choice's text (and, with logprobs, its tokens' before the answer's:
    # the first without one, as nothing precedes it)
    echo: bool | None = Field(default=None, strict=True)
    best_of: Any = None
    # the text after the gap the answer fills (fill in the middle; "": none), for models with FIM tokens
    suffix: str | None = None

    @model_validator(mode="after")
    def _nothing_to_return(self):
        if self.suffix and self.echo:
            raise ApiError(400, "echo and suffix do not go together: the answer fills a gap", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                           param="max_tokens")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    @property
    def logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: none asked."""
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is a chat parameter: send logprobs=N here", param="top_logprobs")
        return None if self.logprobs is None or self.logprobs is False else _top_count(self.logprobs, "logprobs")

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """``echo`` with ``logprobs``: the prompt's tokens' too, with as many alternatives."""
        return self.logprobs_asked if self.echo else None

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


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=65536)
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model as sent
    # honoured: with "auto" a strict function makes the answer's calls held to the schemas (a
    # lazy grammar, specsplit.api.tools.plan); "required" and a named function always are
    strict: bool | None = None

class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)  # assistant only
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)  # tool only, and required

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class Prediction(BaseModel):
    """OpenAI's predicted output: what the answer is expected to be, mostly (a file to edit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: system (or developer), user, assistant and tool turns; text only.
    ``tools`` with ``tool_choice`` "auto" (the default with tools), "none", "required" or a named
    function (``specsplit.api.tools``)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = None  # its tokens go to the ``prediction`` proposer (Job.prediction)
    # vLLM's and SGLang's: more variables for the chat template (Qwen3's enable_thinking, say)
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)
    # vLLM's: the last message, an assistant's, is continued rather than closed (the answer's
    # beginning, given: a prefill), with add_generation_prompt false; and the prompt without the
    # assistant's opening (add_generation_prompt false alone)
    continue_final_message: bool = Field(default=False, strict=True)
    add_generation_prompt: bool = Field(default=True, strict=True)
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _one_budget(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_completion_tokens")
        return self

    @model_validator(mode="after")
    def _tool_choice(self):
        names = {t.function.name for t in self.tools or ()}
        if len(names) < len(self.tools or ()):
            raise ApiError(400, "two tools have the same name", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return self

    @model_validator(mode="after")
    def _continuation(self):
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false (the final message is the "
                                "assistant's turn, continued)", param="add_generation_prompt")
        last = self.messages[-1]
        if last.role != "assistant" or last.tool_calls:
            raise ApiError(400, "continue_final_message: the last message must be the assistant's text",
                           param="messages")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        taken = sorted(set(v or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the server, not a template variable")
        return v

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_asked(self) -> int | None:
        """``logprobs: true``: each token's log-probability, with ``top_logprobs`` alternatives."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ApiError(400, "logprobs must be a boolean", param="logprobs")
        if self.top_logprobs is not None and self.logprobs is not True:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs is not True:
            return None
        return 0 if self.top_logprobs is None else _top_count(self.top_logprobs, "top_logprobs")


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
