"""``POST /tokenize`` and ``POST /detokenize``: the served tokenizer's ids for a text or a
conversation, and the text of ids, in both vLLM's and llama-server's shapes (clients of either,
SillyTavern's and others', count a prompt's tokens before they send it, or show them). One body
model per endpoint takes either shape; a reply carries the fields of both. No generation, so no
orchestrator is asked; the API key check and the model name check are the other endpoints'.

- vLLM: ``{"prompt": TEXT, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true}`` (or ``"continue_final_message": true``, as the chat endpoint
  takes it) -> ``{"count", "max_model_len", "tokens"}``;
  ``{"tokens": [...]}`` -> ``{"prompt": TEXT}``.
- llama-server: ``{"content": TEXT, "add_special": false, "with_pieces": false}`` ->
  ``{"tokens": [...]}`` (with pieces: ``[{"id", "piece"}]``); ``{"tokens": [...]}`` ->
  ``{"content": TEXT}``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from schemas.messages import MAX_CONTEXT_TOKENS
from specsplit.api.plumbing import check_key, encode_text, read_json, request_state
from specsplit.api.protocol import MAX_MESSAGES, ApiError, ChatCompletionRequest, ChatMessage, parse


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, min_length=1, max_length=256)
    prompt: str | None = None  # vLLM's text
    content: str | None = None  # llama-server's text
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)  # vLLM's chat
    add_special_tokens: bool | None = None  # vLLM's: the tokenizer's special tokens around a text (default true)
    add_special: bool | None = None  # llama-server's name for it (default false)
    add_generation_prompt: bool = True  # a conversation's: ready for the assistant's turn
    continue_final_message: bool = Field(default=False, strict=True)  # vLLM's: its last (assistant) message begun
    with_pieces: bool = False  # llama-server's: each token's text beside its id

    @model_validator(mode="after")
    def _one_input(self):
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ApiError(400, "send one of prompt, content or messages", param=given[-1] if given else "prompt")
        if self.add_special_tokens is not None and self.add_special is not None:
            raise ApiError(400, "add_special_tokens and add_special are the same switch: send one",
                           param="add_special")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, min_length=1, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_CONTEXT_TOKENS)


async def _request(request: Request, cls):
    """(the app's state, the body as ``cls``, the served tokenizer), after the endpoints' checks."""
    state = request_state(request)
    check_key(request, state)
    req = parse(cls, await read_json(request, state))
    if req.model is not None:
        state.check_model(req.model)
    return state, req, state.require_ready()


async def tokenize(request: Request) -> Response:
    state, req, tok = await _request(request, TokenizeRequest)
    if req.messages is not None:
        from specsplit.api import tools

        chat = parse(ChatCompletionRequest, {  # (the chat endpoint's rules for continue_final_message)
            "model": req.model or state.model_name or "m", "messages": [m.model_dump() for m in req.messages],
            "add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message})
        turns = tools.turns(chat)
        begun = (turns.pop()["content"] or "") if req.continue_final_message else ""
        try:
            text = tok.tok.apply_chat_template(turns, add_generation_prompt=req.add_generation_prompt or bool(
                req.continue_final_message), tokenize=False) + begun
        except Exception as exc:  # noqa: BLE001  (a template may reject a conversation, e.g. its role order)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        special = bool(req.add_special_tokens)  # the template writes the special tokens itself (vLLM's default)
    else:
        text = req.prompt if req.prompt is not None else req.content
        special = req.add_special_tokens if req.add_special_tokens is not None else \
            bool(req.add_special) if req.add_special is not None else req.prompt is not None
    ids = encode_text(tok, text, special)
    tokens = [{"id": t, "piece": tok.token_piece(t)[0]} for t in ids] if req.with_pieces else ids
    return JSONResponse({"tokens": tokens, "count": len(ids), "max_model_len": state.max_model_len()})


async def detokenize(request: Request) -> Response:
    state, req, tok = await _request(request, DetokenizeRequest)
    ids = state.check_ids(req.tokens, param="tokens")
    text = tok.tok.decode(ids, skip_special_tokens=False)
    return JSONResponse({"prompt": text, "content": text})
