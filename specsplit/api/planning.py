"""Planning a request's choices: the jobs (``specsplit.api.generation.Job``) an OpenAI request
body asks for, checked against the served model and the fleet's context limit (400s naming the
parameter), with their sampling and seeds. No torch.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace

from schemas import SamplingSpec
from schemas.base import MAX_PREDICTION_TOKENS, MAX_PROMPT_LOGPROB_ENTRIES, prompt_logprob_entries
from specsplit.api import tools
from specsplit.api.generation import Job
from specsplit.api.llama_fields import sampling_of
from specsplit.api.protocol import ApiError, ChatCompletionRequest, logit_bias_for, parse
from specsplit.api.state import ApiState
from specsplit.api.structured import constraint_of

SEED_MOD = 2**63


def sampling_for(req, seed: int | None) -> SamplingSpec:
    """The request's sampling; ``top_k: 1`` is greedy decoding (its one token is the greedy one,
    bar exact ties, where greedy takes the first), which verifies trees on the cheaper path."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    top_p, min_p, last, used = 1.0 if req.top_p is None else req.top_p, req.min_p or 0.0, False, []
    if getattr(req, "samplers", None) is not None:  # llama.cpp's chain: which act, the temperature's place
        chain, last, used = sampling_of(req.samplers, temperature, top_k, top_p, min_p)
        temperature, top_k, top_p, min_p = chain["temperature"], chain["top_k"], chain["top_p"], chain["min_p"]
    if top_k == 1:
        temperature, top_k = 0.0, 0
    return SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, temperature_last=last or None,
                        infill=(temperature > 0 and "infill" in used) or None, seed=0 if seed is None else seed,
                        presence_penalty=req.presence_penalty or None, frequency_penalty=req.frequency_penalty or None,
                        repetition_penalty=None if req.repetition_penalty in (None, 1.0) else req.repetition_penalty)


def chat_prompt(tok, req: ChatCompletionRequest, prefill: str = "") -> tuple[list[int], tools.ToolPlan | None]:
    """A chat request's prompt (its turns through the chat template, with its tools shown) and
    its tool plan; a 400 for a model without a template, or one that does not take tools.
    ``prefill``: the assistant's turn begins with it (Anthropic's prefill), the answer its rest."""
    if not tok.has_chat_template:
        raise ApiError(400, "the served model has no chat template: use /v1/completions", param="messages")
    tool_plan = tools.plan(req, tok.added_tokens)
    if (tool_plan or tools.has_tool_turns(req)) and not tools.template_takes_tools(tok.chat_template):
        raise ApiError(400, "the served model's chat template does not take tools (set SPECSPLIT_API_CHAT_TEMPLATE "
                            "to one that does)", param="tools" if tool_plan else "messages")
    turns = tools.turns(req)
    if req.continue_final_message:  # vLLM's prefill: the last (assistant) message continued
        prefill = turns.pop()["content"] or ""
    opened = req.add_generation_prompt or req.continue_final_message
    if not opened and tool_plan and tool_plan.prefill:
        raise ApiError(400, "a forced tool call needs the assistant's turn opened: add_generation_prompt: true",
                       param="add_generation_prompt")
    if prefill and tool_plan and tool_plan.prefill:
        raise ApiError(400, "a forced tool call and an assistant prefill do not go together: the call begins the "
                            "turn", param="tool_choice")
    try:
        ids = tok.encode_chat(turns, tools=tool_plan.tools if tool_plan else None,
                              prefill=prefill or (tool_plan.prefill if tool_plan else ""),
                              variables=req.chat_template_kwargs, opened=opened)
    except Exception as exc:  # noqa: BLE001  (a template may reject a conversation, e.g. its role order)
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    return ids, tool_plan


def renamed(exc: ApiError, params: dict[str, str], texts: tuple[tuple[str, str], ...]) -> ApiError:
    """A chat request's 400 in another API's names (the Responses and Messages APIs run as chat
    requests): ``params`` renames its parameter, ``texts`` the names in its message."""
    exc.param = params.get(exc.param, exc.param) if exc.param else exc.param
    for chat, ours in texts:
        exc.message = exc.message.replace(chat, ours)
    return exc


def as_chat(body: dict, params: dict[str, str], texts: tuple[tuple[str, str], ...]) -> ChatCompletionRequest:
    """The chat request another API's request means (its fields by the chat names, None left
    out); its 400s in that API's names (``renamed``)."""
    try:
        return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
    except ApiError as exc:
        raise renamed(exc, params, texts) from None


def seeds(req, count: int) -> list[int]:
    """One seed per choice: the request's seed + the choice's index (the same seed and request give
    the same output), or fresh random ones."""
    if req.seed is None:
        return [secrets.randbits(63) for _ in range(count)]
    return [(req.seed + i) % SEED_MOD for i in range(count)]


def plan_jobs(req, prompts: list[list[int]], state: ApiState, default_max: int | None, param: str,
              tool_plan: tools.ToolPlan | None = None, echoes: list[str] | None = None) -> list[Job]:
    """The choices to generate; ``echoes``: each prompt's text, returned before its choices'
    (a completion's ``echo``)."""
    limit = state.max_model_len()
    if not limit:  # no orchestrator has said what it admits yet
        raise ApiError(503, "no orchestrator answers", type="server_error", code="service_unavailable")
    jobs: list[Job] = []
    all_seeds = seeds(req, len(prompts) * req.n)
    constraint = constraint_of(req)  # response_format, or vLLM's structured outputs
    if constraint is not None and tool_plan is not None:
        raise ApiError(400, f"{constraint[0]} with tools is not supported: the calls' tags are no JSON",
                       param=constraint[0])
    grammar = constraint[1] if constraint else (tool_plan.grammar if tool_plan else None)  # "required" / named
    bias = logit_bias_for(req, state.tokenizer.vocab_size)
    prediction: tuple[int, ...] = ()
    if getattr(req, "prediction", None) is not None:
        prediction = tuple(state.tokenizer.encode_text(req.prediction.text))
        if len(prediction) > MAX_PREDICTION_TOKENS:
            raise ApiError(400, f"the prediction is {len(prediction)} tokens, over {MAX_PREDICTION_TOKENS}",
                           param="prediction")
    if any(t >= state.tokenizer.vocab_size for t in req.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids: a token id outside 0 to {state.tokenizer.vocab_size - 1}",
                       param="stop_token_ids")
    group = None
    if req.prompt_cache_key is not None:  # a fixed-size token of the client's key: its sessions' routing group
        group = hashlib.blake2b(req.prompt_cache_key.encode(), digest_size=8).hexdigest()
    for p, ids in enumerate(prompts):
        max_tokens = req.budget if isinstance(req, ChatCompletionRequest) else req.max_tokens
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else limit - len(ids)
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                           param="min_tokens")
        if req.min_tokens and grammar is not None:  # where the grammar allows only an end token
            raise ApiError(400, "min_tokens with a constraint on the output (response_format, structured "
                                "outputs, required tool calls) is not supported",
                           param="min_tokens")
        if len(ids) + max(1, max_tokens) > limit or (max_tokens < 1 and echoes is None):
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request has "
                                f"{len(ids)} prompt tokens and asks for {max_tokens} more",
                           param=param, code="context_length_exceeded")
        scored = req.prompt_logprobs_asked if echoes is not None else None
        if scored is not None and prompt_logprob_entries(len(ids), scored) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ApiError(400, f"echo with logprobs={scored} over {len(ids)} prompt tokens is more than the "
                                f"{MAX_PROMPT_LOGPROB_ENTRIES} entries (tokens x (1 + logprobs)) one answer holds",
                           param="logprobs")
        for j in range(req.n):
            k = p * req.n + j
            sampling = sampling_for(req, all_seeds[k]).model_copy(update={"logit_bias": bias})
            jobs.append(Job(k, ids, max_tokens, sampling, tuple(req.stop_strings), p, group, tool_plan, grammar,
                            req.logprobs_asked, echoes[p] if echoes is not None else None, scored,
                            ends_listed=not isinstance(req, ChatCompletionRequest), min_tokens=req.min_tokens,
                            prediction=prediction, include_stop=req.include_stop_str_in_output))
    if group is None and req.n == 1:  # the conversation a prompt continues (``specsplit.api.routes``);
        # a request's several choices stay spread over the workers, as every session without a key
        groups = [state.routes.group_for(ids) for ids in prompts]
        jobs = [replace(job, group=groups[job.prompt_index]) for job in jobs]
    return jobs
