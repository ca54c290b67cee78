"""llama-server's own endpoints over the fleet: ``POST /completion`` (and ``/completions``) and
``POST /infill``, the fill-in-the-middle endpoint that editors' completion plugins call
(llama.vim, llama.vscode), in llama-server's request and response shapes (its
``tools/server/README.md``). No torch.

- ``/infill`` lays out the prompt as llama-server does: the ``input_extra`` chunks first (with
  the model's repository tokens: ``<|repo_name|>myproject``, then ``<|file_sep|>`` and each
  chunk's file name before its text, and ``<|file_sep|>filename`` last), then the FIM prompt
  ``<|fim_prefix|>`` prefix + ``prompt`` ``<|fim_suffix|>`` suffix ``<|fim_middle|>``. The
  prefix keeps its last 3/4 of ``FIM_WINDOW`` tokens, the suffix its first 1/4 (less the
  prompt's), and the chunks their last tokens that fit in the context beside the answer.
- Sampling is llama.cpp's chain: defaults temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
  the temperature applied after the truncations (``SamplingSpec.temperature_last``), or the
  chain ``samplers`` names. What the fleet cannot do exactly is a 400 naming the parameter
  (llama.cpp's window penalties, DRY, XTC, typical-p, mirostat, a chain in another order).
  The ``infill`` sampler that llama.vim and llama.vscode ask for is applied at every node of a
  tree by both models (``SamplingSpec.infill``, ``specsplit.engine.infill``): a choice of
  tokens, as top-p is, so the verifier keeps the answer's distribution exactly llama.cpp's.
- ``n_indent`` and ``t_max_predict_ms`` end an answer by its lines
  (``specsplit.api.textstream.LineLimits``); ``n_predict: 0`` forwards the prompt (the prefix
  caches keep it) and answers nothing, as llama.vim's cache warming asks.
- Fields llama-server takes that change nothing here are accepted at any value (``IGNORED``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from specsplit.api.generation import Done, Failed, Generation
from specsplit.api.llama_fields import IGNORED, OFF_ONLY, check_fields, sampling_of
from specsplit.api.planning import plan_jobs
from specsplit.api.plumbing import check_key, check_unicode, read_json, request_state
from specsplit.api.protocol import MAX_N, MAX_TOP_K, MAX_TOP_LOGPROBS, ApiError, CompletionRequest, parse
from specsplit.api.state import ApiState
from specsplit.api.streaming import answer, each_event, launch, sse
from specsplit.api.textstream import LineLimits
from specsplit.api.tokenizer import ServedTokenizer

FIM_WINDOW = 2048  # llama-server's default batch: the FIM prefix and suffix fit in it (3:1)
SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of chunks for a model without file tokens
REPO_NAME, FILE_NAME = "myproject\n", "filename\n"  # llama-server's names of the repository and the file
MAX_EXTRA_CHUNKS = 1024
MAX_RESPONSE_FIELDS = 64

class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    filename: str = "tmp"


class LlamaRequest(BaseModel):
    """A body of ``/completion`` or ``/infill`` (llama-server's fields and defaults)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    prompt: Any = None
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: list[ExtraChunk] | None = Field(default=None, max_length=MAX_EXTRA_CHUNKS)
    n_predict: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=-1)  # llama-server's aliases of n_predict
    max_completion_tokens: int | None = Field(default=None, ge=-1)
    n_indent: int = Field(default=0, ge=0)
    t_max_predict_ms: int = Field(default=0, ge=-1)
    temperature: float = Field(default=0.8, ge=0.0)
    top_k: int = Field(default=40, le=MAX_TOP_K)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    seed: int = Field(default=-1, ge=-1, le=2**32 - 1)
    stop: list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    ignore_eos: bool = Field(default=False, strict=True)
    logit_bias: Any = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    samplers: list[str] | str | None = None
    n_cmpl: int | None = Field(default=None, ge=1, le=MAX_N)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    return_tokens: bool = False
    # each answer token's log-probability and its n most likely alternatives (the model's, before
    # the sampling chain: llama-server's default), as ``completion_probabilities``
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    response_fields: list[str] | None = Field(default=None, max_length=MAX_RESPONSE_FIELDS)

    def checked(self) -> LlamaRequest:
        """A 400 naming a field this server does not know, or one it honours only when off."""
        for name in self.model_extra or {}:
            if name not in IGNORED and name not in OFF_ONLY:
                raise ApiError(400, f"unknown parameter {name!r}: not supported by this server", param=name,
                               code="unsupported_parameter")
        check_fields(self.model_extra or {})
        if self.grammar and self.json_schema is not None:
            raise ApiError(400, "grammar and json_schema both constrain the output: send one", param="grammar")
        return self

    @property
    def budget(self) -> int:
        """n_predict, or an alias of it: -1 until an end (or the context is full)."""
        given = [v for v in (self.n_predict, self.max_tokens, self.max_completion_tokens) if v is not None]
        return given[0] if given else -1


def logit_bias_of(req: LlamaRequest, tok: ServedTokenizer) -> dict[str, float] | None:
    """llama-server's ``logit_bias`` (``[[id or text, bias], ...]`` or ``{"id or text": bias}``;
    a text biases each of its tokens; ``false``: never, here a bias of -100) as OpenAI's."""
    lb = req.logit_bias
    if lb is None or lb == [] or lb == {}:
        return None
    if isinstance(lb, dict):
        pairs = list(lb.items())
    elif isinstance(lb, list) and all(isinstance(p, list) and len(p) == 2 for p in lb):
        pairs = [tuple(p) for p in lb]
    else:
        raise ApiError(400, "logit_bias must be [[token id or text, bias], ...] or {token id or text: bias}",
                       param="logit_bias")
    out: dict[str, float] = {}
    for key, bias in pairs:
        if bias is False:
            bias = -100.0
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(400, "logit_bias: a bias is a number or false", param="logit_bias")
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            ids = [int(key)]
        elif isinstance(key, str):
            ids = tok.encode_plain(key)
        else:
            raise ApiError(400, "logit_bias: a key is a token id or a text", param="logit_bias")
        for t in ids:
            out[str(t)] = float(bias)
    return out


def prompt_pieces(value: Any) -> list[list[int | str]]:
    """llama-server's ``prompt``: a text, token ids and texts mixed (one prompt), or a list of
    those without bare ids at its top (several prompts)."""
    def piece_list(p: Any) -> list[int | str]:
        items = p if isinstance(p, list) else [p]
        if not items or not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                                for x in items):
            raise ApiError(400, "prompt: a text, token ids, or a list of them", param="prompt")
        return items
    if isinstance(value, list) and value and not any(isinstance(x, int) for x in value):
        return [piece_list(p) for p in value]
    return [piece_list(value)]


def encode_mixed(tok: ServedTokenizer, pieces: list[int | str], state: ApiState, first_special: bool) -> list[int]:
    """A mixed prompt's ids: texts read with special tokens' names (the first with the tokenizer's
    own tokens added when ``first_special``), ids as they are."""
    out: list[int] = []
    for k, p in enumerate(pieces):
        if isinstance(p, str):
            out += tok.encode(p) if k == 0 and first_special else tok.encode_text(p)
        else:
            out += state.check_ids([p])
    return out


def infill_ids(tok: ServedTokenizer, req: LlamaRequest, state: ApiState) -> list[int]:
    """The FIM prompt of an ``/infill`` body (the module docstring's layout)."""
    if tok.fim is None:
        raise ApiError(400, "infill needs fill-in-the-middle tokens: the served model has none",
                       param="input_prefix")
    if req.input_prefix is None or req.input_suffix is None:
        missing = "input_prefix" if req.input_prefix is None else "input_suffix"
        raise ApiError(400, f"{missing} is required", param=missing)
    if req.prompt is not None and not isinstance(req.prompt, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    pre, suf, mid = tok.ids_of(tok.fim)
    prompt = tok.encode_text(req.prompt or "")
    prefix, suffix = tok.encode_plain(req.input_prefix), tok.encode_plain(req.input_suffix)
    prefix = prefix[max(0, len(prefix) - 3 * (FIM_WINDOW // 4)):]
    suffix = suffix[:max(0, FIM_WINDOW // 4 - (2 + len(prompt)))]
    fim = [*tok.bos, pre, *prefix, *prompt, suf, *suffix, mid]
    extra: list[int] = []
    repo, sep = tok.ids_of(tok.fim_repo) if tok.fim_repo else (None, None)
    if repo is not None:
        extra += [repo, *tok.encode_plain(REPO_NAME)]
    for chunk in req.input_extra or ():
        extra += [sep, *tok.encode_plain(chunk.filename + "\n")] if sep is not None else tok.encode_plain(SNIPPET)
        extra += tok.encode_plain(chunk.text)
    if sep is not None:
        extra += [sep, *tok.encode_plain(FILE_NAME)]
    n = req.budget
    room = state.max_model_len() - len(fim) - (n if n > 0 else 1 if n == 0 else FIM_WINDOW // 4)
    take = max(0, min(len(extra), room))
    return extra[len(extra) - take:] + fim


def plan(req: LlamaRequest, state: ApiState, tok: ServedTokenizer, infill: bool):
    """The request's prompts (ids and texts) and jobs."""
    if infill:
        prompts = [infill_ids(tok, req, state)]
    else:
        for name in ("input_prefix", "input_suffix", "input_extra"):
            if getattr(req, name) is not None:
                raise ApiError(400, f"{name} is a parameter of /infill", param=name)
        if req.prompt is None:
            raise ApiError(400, '"prompt" is required', param="prompt")
        prompts = [encode_mixed(tok, p, state, first_special=True) for p in prompt_pieces(req.prompt)]
    if any(not p for p in prompts):
        raise ApiError(400, "a prompt encodes to no tokens", param="prompt")
    fields, last, used = sampling_of(req.samplers, req.temperature, req.top_k, req.top_p, req.min_p)
    n = req.budget
    body = {"model": state.model_name, "prompt": prompts, "max_tokens": None if n < 0 else max(1, n),
            **fields, "n": req.n_cmpl or req.n or 1, "seed": None if req.seed < 0 else req.seed,
            "stop": req.stop, "stream": req.stream, "ignore_eos": req.ignore_eos,
            "logit_bias": logit_bias_of(req, tok), "logprobs": req.n_probs or None}
    if req.grammar:
        body["guided_grammar"] = req.grammar
    elif req.json_schema is not None:
        body["guided_json"] = req.json_schema or {"type": "object"}  # (llama-server's: {} is any object)
    creq = parse(CompletionRequest, body)
    lines = LineLimits(req.n_indent, max(0, req.t_max_predict_ms) / 1000)
    jobs = [dataclasses.replace(j, max_tokens=0 if n == 0 else j.max_tokens, lines=lines or None,
                                sampling=j.sampling.model_copy(update={
                                    "temperature_last": last or None,
                                    "infill": (not j.sampling.greedy and "infill" in used) or None}))
            for j in plan_jobs(creq, prompts, state, None, "n_predict")]
    return creq, prompts, jobs, used


class Shaper:
    """llama-server's response objects for one request."""

    def __init__(self, req: LlamaRequest, state: ApiState, gen: Generation, prompts: list[list[int]],
                 used: list[str]) -> None:
        self.req, self.state, self.gen, self.prompts = req, state, gen, prompts
        self.settings = {"n_predict": req.budget, "seed": req.seed, "temperature": req.temperature,
                         "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "stop": req.stop or [],
                         "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms,
                         "ignore_eos": req.ignore_eos, "stream": req.stream, "samplers": used,
                         "grammar": req.grammar or "", "speculative": True}

    def partial(self, index: int, text: str, logprobs=()) -> dict:
        choice = self.gen.choices[index]
        out = {"index": index, "content": text, "tokens": [], "stop": False, "id_slot": -1,
               "tokens_predicted": choice.tokens, "tokens_evaluated": len(choice.job.prompt_ids)}
        if logprobs:
            out["completion_probabilities"] = self.probabilities(logprobs)
        return out

    def probabilities(self, entries) -> list[dict]:
        """llama-server's ``completion_probabilities``: each token (its text, bytes, log-probability)
        with its ``n_probs`` most likely alternatives."""
        piece = self.state.tokenizer.token_piece

        def one(t: int, lp: float | None) -> dict:
            text, raw = piece(t)
            return {"id": t, "token": text, "bytes": list(raw), "logprob": lp}

        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top or ()]}
                for e in entries]

    def final(self, done: Done, text: str, ended: float, logprobs=()) -> dict:
        choice = self.gen.choices[done.index]
        job = choice.job
        ttft = done.speculative.get("time_to_first_token_s")
        total_ms = (ended - self.gen.arrived) * 1000
        prompt_ms = ttft * 1000 if ttft is not None else total_ms
        gen_ms = max(0.0, total_ms - prompt_ms)
        fresh = len(job.prompt_ids) - done.cached_tokens
        timings = {"cache_n": done.cached_tokens, "prompt_n": fresh, "prompt_ms": prompt_ms,
                   "prompt_per_token_ms": prompt_ms / fresh if fresh else 0.0,
                   "prompt_per_second": fresh / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
                   "predicted_n": done.completion_tokens, "predicted_ms": gen_ms,
                   "predicted_per_token_ms": gen_ms / done.completion_tokens if done.completion_tokens else 0.0,
                   "predicted_per_second": done.completion_tokens / gen_ms * 1000 if gen_ms > 0 else 0.0}
        if done.speculative.get("drafted_tokens") is not None:
            timings.update(draft_n=done.speculative["drafted_tokens"],
                           draft_n_accepted=done.speculative["accepted_tokens"])
        if done.stop_word is not None:
            stop_type = "word"
        elif done.limited or done.finish_reason == "length":
            stop_type = "limit"
        else:
            stop_type = "eos"
        out = {"index": done.index, "content": text,
               "tokens": list(choice.streamed) if self.req.return_tokens else [], "id_slot": -1, "stop": True,
               "model": self.state.model_name, "tokens_predicted": done.completion_tokens,
               "tokens_evaluated": len(job.prompt_ids), "generation_settings": self.settings,
               "prompt": self.state.tokenizer.tok.decode(job.prompt_ids, skip_special_tokens=False),
               "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
               "stopping_word": done.stop_word or "", "tokens_cached": len(job.prompt_ids) + done.completion_tokens,
               "timings": timings}
        if logprobs:
            out["completion_probabilities"] = self.probabilities(logprobs)
        return nested(self.req.response_fields, out) if self.req.response_fields else out

    def whole(self, events: list) -> dict | list:
        """The answers of a request not streamed: one object, or a list for several."""
        texts: dict[int, str] = {c.job.index: "" for c in self.gen.choices}
        probs: dict[int, list] = {i: [] for i in texts}
        results = []
        for ev in events:
            texts[ev.index] += ev.text
            probs[ev.index].extend(ev.logprobs)
            if isinstance(ev, Done):
                results.append(self.final(ev, texts[ev.index], time.perf_counter(), probs[ev.index]))
        results.sort(key=lambda r: r.get("index", 0))
        return results[0] if len(results) == 1 else results


def nested(paths: list[str], obj: dict) -> dict:
    """llama-server's ``response_fields``: each path's value (``a/b``: ``obj[a][b]``) under the
    path itself; a path that leads nowhere is left out."""
    out = {}
    for path in paths:
        at: Any = obj
        for key in path.split("/"):
            if not isinstance(at, dict) or key not in at:
                break
            at = at[key]
        else:
            out[path] = at
    return out


async def native(request: Request, infill: bool) -> Response:
    state = request_state(request)
    check_key(request, state)
    body = await read_json(request, state)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    req = parse_llama(body)
    tok = state.require_ready()
    _, prompts, jobs, used = plan(req, state, tok, infill)
    ends = tok.eog_token_ids  # llama.cpp's ends of generation (its FIM separators too)
    gen, release = launch(state, jobs, [] if req.ignore_eos else ends, unlisted=ends)
    shaper = Shaper(req, state, gen, prompts, used)
    return await answer(request, gen, release, req.stream, lambda first: stream_native(gen, first, shaper, release),
                        shaper.whole)


async def stream_native(gen: Generation, first, shaper: Shaper, release):
    """llama-server's stream: a chunk per text delta, then each answer's last chunk (``stop``:
    true, the final fields, its content already sent); no ``[DONE]``."""
    try:
        async for ev in each_event(gen, first):
            if isinstance(ev, Failed):
                yield sse(ev.error.body())
                continue
            if ev.text or ev.logprobs:
                yield sse(shaper.partial(ev.index, ev.text, ev.logprobs))
            if isinstance(ev, Done):
                yield sse(shaper.final(ev, "", time.perf_counter()))
    finally:
        release()


def parse_llama(body: dict) -> LlamaRequest:
    """A validated llama-server body, or ApiError(400) naming the first offending field."""
    from pydantic import ValidationError

    check_unicode(body)
    try:
        return LlamaRequest.model_validate(body).checked()
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise ApiError(400, f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}", param=param) from None


async def completion(request: Request) -> Response:
    """``POST /completion`` (and ``/completions``): llama-server's completion of a prompt."""
    return await native(request, infill=False)


async def infill(request: Request) -> Response:
    """``POST /infill``: llama-server's fill in the middle, for editors' completion plugins."""
    return await native(request, infill=True)
