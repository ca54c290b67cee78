"""``specsplit api``: the OpenAI-compatible HTTP front door of the fleet (Starlette on uvicorn).

A producer of the orchestrators (``specsplit.pool.OrchestratorPool``: spread over the live ones,
resumed after a loss) that speaks HTTP: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions``, the Responses API's ``/v1/responses`` (``specsplit.api.responses``),
Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (``specsplit.api.messages``),
llama-server's ``POST /completion`` and ``/infill`` (``specsplit.api.llama_server``), ``POST
/tokenize`` and ``/detokenize`` (``specsplit.api.tokens``), ``GET /health``, ``GET /metrics``.
It loads the target's tokenizer only (no torch, no weights) and checks it against the tokenizer
the orchestrators report (``Heartbeat.tokenizer_hash``): another one ends the process with code
2, naming both.

Limits: a body over ``api_max_body_bytes`` gets 413 before it is read; headers must arrive
within ``api_header_timeout_s`` of connecting (the connection is closed otherwise), a body within
``api_body_timeout_s`` (408). Beyond ``api_max_concurrent_requests`` generations at once: 429.
"""

from __future__ import annotations

import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specsplit.api import llama_server, messages, responses, tools
from specsplit.api.generation import Done, Failed, Generation
from specsplit.api.logprobs import Piece, chat_logprobs, completion_logprobs
from specsplit.api.metrics import ApiMetrics
from specsplit.api.planning import chat_prompt, plan_jobs
from specsplit.api.plumbing import check_key, encode_text, read_json, request_state
from specsplit.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from specsplit.api.state import ApiState
from specsplit.api.streaming import answer, each_event, launch, sse
from specsplit.api.tokens import detokenize, tokenize


# ---------------------------------------------------------------------------- responses
class Responder:
    """OpenAI's response and chunk shapes for one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, logprobs: int | None = None, piece: Piece | None = None) -> None:
        """``logprobs``: asked for (``piece`` names a token: its text and bytes)."""
        self.chat, self.model, self.asked, self.piece = chat, model, logprobs, piece
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, usage=None, include_usage: bool = False) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or include_usage:
            out["usage"] = usage
        return out

    def logprobs(self, entries) -> dict | None:
        """A choice's (or a chunk's) ``logprobs``: None when not asked for."""
        if self.asked is None:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(list(entries), self.piece)

    def full(self, done: dict[int, Done], texts: dict[int, str], calls: dict[int, list] | None = None,
             logprobs: dict[int, list] | None = None) -> dict:
        choices = []
        for i in sorted(done):
            d = done[i]
            lp = self.logprobs((logprobs or {}).get(i, ()))
            if self.chat:
                made = (calls or {}).get(i)
                message = {"role": "assistant", "content": texts[i] or (None if made else texts[i])}
                if made:
                    message["tool_calls"] = [call.message() for call in made]
                c = {"index": i, "message": message, "logprobs": lp, "finish_reason": d.finish_reason}
            else:
                c = {"index": i, "text": texts[i], "logprobs": lp, "finish_reason": d.finish_reason}
            choices.append({**c, "speculative": d.speculative})
        return self._envelope(self.object, choices, usage(done))

    def chunk(self, index: int, text: str | None, finish: Done | None = None, *, first: bool = False,
              include_usage: bool = False, calls=(), logprobs=()) -> dict:
        lp = self.logprobs(logprobs) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            if calls:
                delta["tool_calls"] = [call.delta() for call in calls]
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}
        else:
            c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": None}
        if finish is not None:
            c["finish_reason"] = finish.finish_reason
            c["speculative"] = finish.speculative
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [c], include_usage=include_usage)

    def usage_chunk(self, done: dict[int, Done]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage(done))


def usage(done: dict[int, Done]) -> dict:
    """OpenAI's usage: each prompt's tokens once (whatever n), every choice's tokens; of the
    prompts' tokens, those the target copied from its prefix cache (``cached_tokens``: per
    prompt, the most any of its choices had); with a predicted output, its tokens the answers
    took up and those they did not (``proposers.prediction.followed``)."""
    prompt = sum({d.prompt_index: d.prompt_tokens for d in done.values()}.values())
    cached: dict[int, int] = {}
    for d in done.values():
        cached[d.prompt_index] = max(cached.get(d.prompt_index, 0), d.cached_tokens)
    completion = sum(d.completion_tokens for d in done.values())
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    predicted = [d.prediction for d in done.values() if d.prediction is not None]
    if predicted:  # a predicted output's tokens, taken up or not, over every choice
        out["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in predicted),
                                            "rejected_prediction_tokens": sum(r for _, r in predicted)}
    return out


async def run_generation(request: Request, state: ApiState, req, prompts: list[list[int]], chat: bool,
                         default_max: int | None, param: str, tool_plan: tools.ToolPlan | None = None,
                         echoes: list[str] | None = None) -> Response:
    jobs = plan_jobs(req, prompts, state, default_max, param, tool_plan, echoes)
    responder = Responder(chat, state.model_name, req.logprobs_asked, state.tokenizer.token_piece)
    ends = state.tokenizer.stop_token_ids  # (a chat's logprobs do not list them)
    stops = sorted({*([] if req.ignore_eos else ends), *(req.stop_token_ids or ())})
    gen, release = launch(state, jobs, stops, unlisted=ends)
    return await answer(request, gen, release, req.stream,
                        lambda first: stream_events(gen, first, responder, req, release),
                        lambda events: collected(events, gen, responder))


def collected(events: list, gen: Generation, responder: Responder) -> dict:
    """The whole answer of every choice from its events."""
    texts: dict[int, str] = {j.index: "" for j in (c.job for c in gen.choices)}
    calls: dict[int, list] = {i: [] for i in texts}
    logprobs: dict[int, list] = {i: [] for i in texts}
    done: dict[int, Done] = {}
    for ev in events:
        texts[ev.index] += ev.text
        calls[ev.index].extend(ev.calls)
        logprobs[ev.index].extend(ev.logprobs)
        if isinstance(ev, Done):
            done[ev.index] = ev
    return responder.full(done, texts, calls, logprobs)


async def stream_events(gen: Generation, first, responder: Responder, req, release):
    """SSE: one chunk per text delta, a last chunk per choice with its finish reason, the usage
    chunk when asked, then [DONE]. Leaving early (the client disconnected) cancels every session."""
    done: dict[int, Done] = {}
    include = req.include_usage
    try:
        if responder.chat:
            for c in gen.choices:
                yield sse(responder.chunk(c.job.index, None, first=True, include_usage=include))
        async for ev in each_event(gen, first):
            if isinstance(ev, Failed):
                yield sse(ev.error.body())
                continue
            if ev.text or ev.logprobs:
                yield sse(responder.chunk(ev.index, ev.text, include_usage=include, logprobs=ev.logprobs))
            if ev.calls:
                yield sse(responder.chunk(ev.index, None, include_usage=include, calls=ev.calls))
            if isinstance(ev, Done):
                done[ev.index] = ev
                yield sse(responder.chunk(ev.index, None, ev, include_usage=include))
        if include and len(done) == len(gen.choices):
            yield sse(responder.usage_chunk(done))
        yield b"data: [DONE]\n\n"
    finally:
        release()


# ---------------------------------------------------------------------------- endpoints
async def completions(request: Request) -> Response:
    state = request_state(request)
    check_key(request, state)
    req = parse(CompletionRequest, await read_json(request, state))
    state.check_model(req.model)
    tok = state.require_ready()
    raw = req.prompts()
    if req.suffix:  # fill in the middle: each prompt is the text before the gap
        if tok.fim is None:
            raise ApiError(400, "suffix needs fill-in-the-middle tokens: the served model has none", param="suffix")
        raw = [tok.infill(p if isinstance(p, str) else state.check_ids(p), req.suffix) for p in raw]
    prompts = [encode_text(tok, p) if isinstance(p, str) else state.check_ids(p) for p in raw]
    if any(not p for p in prompts):
        raise ApiError(400, "a prompt encodes to no tokens", param="prompt")
    echoes = [p if isinstance(p, str) else tok.decode(ids) for p, ids in zip(req.prompts(), prompts)] \
        if req.echo else None
    return await run_generation(request, state, req, prompts, False, req.max_tokens, "max_tokens", echoes=echoes)


async def chat_completions(request: Request) -> Response:
    state = request_state(request)
    check_key(request, state)
    req = parse(ChatCompletionRequest, await read_json(request, state))
    state.check_model(req.model)
    ids, tool_plan = chat_prompt(state.require_ready(), req)
    return await run_generation(request, state, req, [ids], True, None,
                                "max_completion_tokens" if req.max_completion_tokens else "max_tokens", tool_plan)


async def models(request: Request) -> Response:
    """``GET /v1/models``, and ``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``):
    the served model, or a 404 naming the model asked for; in Anthropic's shapes for its clients."""
    state = request_state(request)
    check_key(request, state)
    state.require_ready()
    card = {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "specsplit",
            "max_model_len": state.max_model_len()}
    if messages.anthropic_client(request):  # Anthropic's client.models: its shape
        card = messages.model_info(state.model_name, state.started, state.max_model_len())
    if "model" in request.path_params:
        state.check_model(request.path_params["model"])
        return JSONResponse(card)
    if "type" in card:
        return JSONResponse({"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]})
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    state = request_state(request)
    ok, why = state.serving()
    return JSONResponse({"status": "ok" if ok else "unavailable", "detail": why}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(request_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------- the app
def build_app(state: ApiState) -> Starlette:
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        body = messages.api_error_body(exc) if messages.anthropic_client(request) else exc.body()
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else None
        return await on_api_error(request, ApiError(exc.status_code, str(exc.detail), code=kind,
                                                    headers=getattr(exc, "headers", None)))

    async def on_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; the generation was cancelled

    async def on_error(request: Request, exc: Exception) -> Response:
        state.log.exception("api_internal_error", path=request.url.path)
        return await on_api_error(request, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                                    code="internal_error"))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/completion", llama_server.completion, methods=["POST"]),
        Route("/completions", llama_server.completion, methods=["POST"]),
        Route("/infill", llama_server.infill, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=state.lifespan,
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                        ClientDisconnect: on_disconnect, Exception: on_error})
    app.state.api = state
    app.router.redirect_slashes = False  # /v1/completions/ is a 404 like any unknown path, not a redirect
    return CountResponses(app, state.metrics)


class CountResponses:
    """ASGI middleware: every HTTP response counted by route and status."""

    def __init__(self, app, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(scope.get("path", ""), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
