"""Log-probabilities and penalties through the HTTP API as people ask for them: ``honcho
start`` of the repository's Procfile and .env (tiny fp32 pair), the official ``openai`` client;
chat (``logprobs``, ``top_logprobs``) and completions (``logprobs=N``), whole and streamed.

Each listed token is a token of the answer, in order, their bytes spelling its text; each
log-probability and alternative is the target's at that position (full re-forwards of prompt +
answer); a chat's end tokens are not listed, a completion's are; a stop string lists the tokens
whose text begins before it. ``echo`` returns the prompt before the answer, with ``logprobs`` its
tokens' log-probabilities too (the first token's null), as lm-eval's loglikelihood reads them.
With ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` and ``logit_bias`` the
answer is plain greedy decoding with them (tests/test_penalties.py's oracle), and stays so, its
log-probabilities too, when the process of the target or of the orchestrator serving it is
killed -9 mid-stream.
"""

from __future__ import annotations

import pytest
import torch

from tests.api_fleet import api_error, api_fleet, expected, openai_client, post_json, tiny_pair
from tests.conftest import greedy_reference

pytestmark = [pytest.mark.system, pytest.mark.slow]
TOP = 3


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    yield from api_fleet(tmp_path_factory)


def reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(out)], dim=-1)


def check_position(tok, row: torch.Tensor, token_id: int, logprob: float, top: list[tuple[str, float]]) -> None:
    assert abs(logprob - float(row[token_id])) < 1e-4
    values, ids = row.topk(len(top))
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
    if len(top) < 2 or float((values[1:] - values[:-1]).abs().min()) > 1e-4:  # no tie to reorder them
        assert [t for t, _ in top] == [tok.token_piece(i)[0] for i in ids.tolist()]


def same(a, b) -> bool:
    """Equal JSON values, floats to 1e-4."""
    if hasattr(a, "model_dump"):
        a, b = a.model_dump(), b.model_dump()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, (int, float)) and abs(a - b) < 1e-4
    return a == b


def test_chat_logprobs_are_the_targets_whole_and_streamed(fleet, tiny):
    model, tok, _ = tiny
    messages = [{"role": "user", "content": "Say something."}]
    ids = tok.encode_chat(messages)
    generated = expected(model, tok, ids, 40)
    out = [t for t in generated if t not in tok.stop_token_ids]
    client = openai_client(fleet)
    body = {"model": "tiny-v1", "messages": messages, "max_tokens": 40, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP}
    whole = client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.token_piece(t)[0] for t in out]
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text == whole.choices[0].message.content == tok.decode(out)
    for e, t, row in zip(content, out, reference(model, ids, out)):
        check_position(tok, row, t, e.logprob, [(x.token, x.logprob) for x in e.top_logprobs])
        assert all(bytes(x.bytes) == x.token.encode() or "\ufffd" in x.token for x in e.top_logprobs)
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices
                for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert same(streamed, content)  # (another run: its trees may differ, so its sums in the last bits)
    plain = client.chat.completions.create(**{**body, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_with_a_stop_string(fleet, tiny):
    """The legacy shape (tokens, token_logprobs, top_logprobs maps that hold the chosen token,
    text_offset); a stop string chosen to begin inside a token."""
    model, tok, _ = tiny
    prompt = tok.encode("The weather today")
    out = [t for t in expected(model, tok, prompt, 32) if t not in tok.stop_token_ids]
    pieces = [tok.decode(out[:k]) for k in range(len(out) + 1)]
    # a stop string from inside the 6th token's text on (or the first multi-character one after it)
    k = next(i for i in range(5, len(out)) if len(pieces[i + 1]) - len(pieces[i]) >= 2)
    cut = len(pieces[k]) + 1
    stop = pieces[-1][cut:cut + 3]
    assert len(stop) == 3 and pieces[-1].find(stop) == cut
    client = openai_client(fleet)
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": TOP, "stop": [stop]}
    whole = client.completions.create(**body)
    choice = whole.choices[0]
    assert choice.text == pieces[-1][:cut]
    lp = choice.logprobs
    assert lp.tokens == [tok.token_piece(t)[0] for t in out[:k + 1]]  # the last one: its text cut by the stop
    # where each token's text begins in the answer (a token holding part of a character: where
    # that character begins); where the text before it decodes whole, its length
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice.text)
    assert all(offsets[i] == len(pieces[i]) for i in range(k + 1) if "\ufffd" not in pieces[i + 1])
    checked = 0
    for i, (t, row) in enumerate(zip(out, reference(model, prompt, out[:k + 1]))):
        top = lp.top_logprobs[i]
        names = [tok.token_piece(j)[0] for j in {*row.topk(TOP).indices.tolist(), t}]
        if len(set(names)) < len(names):  # two tokens of one text share a key of the map
            continue
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        check_position(tok, row, t, lp.token_logprobs[i], sorted(top.items(), key=lambda kv: -kv[1])[:TOP])
        checked += 1
    assert checked >= 3
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert same(streamed, lp.model_dump())


def test_bad_logprobs_are_a_400_naming_them(fleet):
    chat = {"model": "tiny-v1", "messages": [{"role": "user", "content": "hi"}]}
    api_error(post_json(fleet, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400,
              param="top_logprobs")
    api_error(post_json(fleet, "/v1/chat/completions", {**chat, "top_logprobs": 1}), 400, param="top_logprobs")
    api_error(post_json(fleet, "/v1/chat/completions", {**chat, "logprobs": "yes"}), 400, param="logprobs")
    ok = {"model": "tiny-v1", "prompt": "hi", "max_tokens": 2}
    api_error(post_json(fleet, "/v1/completions", {**ok, "logprobs": -1}), 400, param="logprobs")
    api_error(post_json(fleet, "/v1/completions", {**ok, "logprobs": 2.5}), 400, param="logprobs")
    fine = post_json(fleet, "/v1/completions", {**ok, "logprobs": 0})
    assert fine.status_code == 200 and len(fine.json()["choices"][0]["logprobs"]["tokens"]) <= 2, fine.text


def test_penalties_and_a_logit_bias_give_greedy_decoding_with_them(fleet, tiny):
    from tests.test_penalties import penalized_greedy

    model, tok, _ = tiny
    messages = [{"role": "user", "content": "Say something."}]
    ids = tok.encode_chat(messages)
    client = openai_client(fleet)
    first = next(t for t in expected(model, tok, ids, 24) if t < tok.vocab_size)  # (the tiny model has more ids)
    for penalties in ({"presence_penalty": -2.0, "frequency_penalty": 0.5},
                      {"frequency_penalty": 0.4, "extra_body": {"repetition_penalty": 3.0}},
                      {"logit_bias": {str(first): -100, "7": 4.5}}):
        extra = penalties.pop("extra_body", {})
        bias = {int(k): v for k, v in penalties.get("logit_bias", {}).items()}
        want = penalized_greedy(model, ids, 24, penalties.get("presence_penalty"), penalties.get("frequency_penalty"),
                                extra.get("repetition_penalty"), bias)
        cut = next((i + 1 for i, t in enumerate(want) if t in tok.stop_token_ids), len(want))
        text = tok.decode(want[:cut])
        assert want != expected(model, tok, ids, 24)  # the penalties change the answer
        body = {"model": "tiny-v1", "messages": messages, "max_tokens": 24, "temperature": 0, **penalties}
        whole = client.chat.completions.create(**body, extra_body=extra)
        assert whole.choices[0].message.content == text and whole.usage.completion_tokens == cut
        stream = client.chat.completions.create(**body, extra_body=extra, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize("role", ["target", "orchestrator"])
def test_penalties_and_logprobs_survive_a_kill(fleet, tiny, role):
    """A long penalized answer with logprobs streams while a process serving it is killed -9.
    The target's: the other target takes the session (a resend from an empty cache rebuilds the
    penalties' state). The orchestrator's: the API resumes the generation on its successor, the
    output so far as prompt with ``output_from`` where the output began, so the penalties still
    count it. Either way the text is the oracle's and every token's log-probability is listed,
    the echoed prompt's first."""
    from tests.api_fleet import stream_killing
    from tests.test_penalties import penalized_greedy

    model, tok, _ = tiny
    prompt = [5, 17, 99, 3, 250]
    want = penalized_greedy(model, prompt, 400, 0.3, 0.2)
    cut = next((i + 1 for i, t in enumerate(want) if t in tok.stop_token_ids), len(want))
    want = want[:cut]
    assert len(want) > 200, "the answer should outlast the kill"
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "presence_penalty": 0.3, "frequency_penalty": 0.2, "logprobs": 1, "echo": True}
    choices = stream_killing(fleet, body, role)
    text = "".join(c["text"] for c in choices)
    listed = [lp for c in choices for lp in (c["logprobs"] or {}).get("token_logprobs", [])]
    assert text == tok.decode(prompt) + tok.decode(want)  # echo: the prompt first
    rows = reference(model, prompt[:1], prompt[1:] + want)  # the prompt's tokens after its first, then the answer's
    assert len(listed) == len(prompt) + len(want)  # a completion lists its end token too
    assert listed[0] is None
    assert all(abs(lp - float(row[t])) < 1e-4 for lp, t, row in zip(listed[1:len(prompt)], prompt[1:], rows))
    assert all(abs(lp - float(row[t])) < 1e-4 for lp, t, row in zip(listed[len(prompt):], want, rows[len(prompt) - 1:]))


def loglikelihood(choice, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's ``local-completions`` model makes of an answer to its loglikelihood request
    (echo, max_tokens 1, logprobs 1): the continuation's log-probability (the prompt's tokens
    from ``ctxlen`` on, the generated token cut off) and whether each of its tokens was the most
    likely one."""
    lps = choice.logprobs.token_logprobs[ctxlen:-1]
    tops = choice.logprobs.top_logprobs[ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks_for_them(fleet, tiny):
    """lm-eval's request, token prompts batched: each choice lists every prompt token (the first
    with null) and the one generated token; the continuation's log-likelihood and greediness
    are the target's (one forward of the prompt)."""
    model, tok, _ = tiny
    contexts = [tok.encode("The capital of France is"), tok.encode("def add(a, b):")]
    conts = [tok.encode(" Paris, of course."), tok.encode("\n    return a + b")]
    prompts = [c + x for c, x in zip(contexts, conts)]
    prompts.append([*contexts[1], *greedy_reference(model, contexts[1], 3)[0]])  # a greedy continuation
    conts.append(prompts[2][len(contexts[1]):])
    contexts.append(contexts[1])
    client = openai_client(fleet)
    res = client.completions.create(model="tiny-v1", prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                    temperature=0, seed=1234)
    choices = sorted(res.choices, key=lambda c: c.index)
    assert len(choices) == 3 and res.usage.completion_tokens == 3
    greedy = []
    for choice, prompt, ctx in zip(choices, prompts, contexts):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1  # the prompt's tokens, then the one generated
        assert lp.tokens[:len(prompt)] == [tok.token_piece(t)[0] for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [P, V]
        for i in range(1, len(prompt)):
            check_position(tok, rows[i - 1], prompt[i], lp.token_logprobs[i],
                           sorted(lp.top_logprobs[i].items(), key=lambda kv: -kv[1])[:1])
        made = int(rows[-1].argmax())  # the generated token: greedy, listed whatever it is
        assert lp.tokens[-1] == tok.token_piece(made)[0]
        assert choice.text == tok.decode(prompt) + tok.decode([made])
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert lp.text_offset[len(prompt)] == len(tok.decode(prompt))
        got, is_greedy = loglikelihood(choice, len(ctx))
        cont = prompt[len(ctx):]
        want = sum(float(rows[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
        assert got == pytest.approx(want, abs=1e-3)
        assert is_greedy == all(int(rows[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
        greedy.append(is_greedy)
    assert greedy[2] and not all(greedy)  # (both kinds were checked)


def test_echo_streamed_alone_and_without_logprobs(fleet, tiny):
    """Streamed: the prompt's text and log-probabilities come first, and the chunks join to the
    whole answer. ``max_tokens: 0``: the prompt alone, no token generated. Echo without logprobs:
    the prompt's text before the answer. ``max_tokens: 0`` without echo asks for nothing: a 400."""
    model, tok, _ = tiny
    text = "Once upon a time"
    prompt = tok.encode(text)
    client = openai_client(fleet)
    body = {"model": "tiny-v1", "prompt": text, "echo": True, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**body).choices[0]
    answer = expected(model, tok, prompt, 8)
    assert whole.text == text + tok.decode(answer)
    assert len(whole.logprobs.tokens) == len(prompt) + len(answer)
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert chunks[0].text == text and len(chunks[0].logprobs.tokens) == len(prompt)  # the prompt first
    assert "".join(c.text for c in chunks) == whole.text
    streamed = {k: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, k)]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert same(streamed, whole.logprobs.model_dump())
    alone = client.completions.create(**{**body, "max_tokens": 0})
    assert alone.choices[0].text == text and alone.usage.completion_tokens == 0
    assert alone.choices[0].finish_reason == "length"
    assert same(alone.choices[0].logprobs.model_dump(),
                {k: v[:len(prompt)] for k, v in whole.logprobs.model_dump().items()})
    plain = client.completions.create(**{**body, "logprobs": None})
    assert plain.choices[0].text == whole.text and plain.choices[0].logprobs is None
    api_error(post_json(fleet, "/v1/completions", {**body, "echo": False, "max_tokens": 0}), 400, param="max_tokens")
    api_error(post_json(fleet, "/v1/completions", {**body, "echo": "yes"}), 400, param="echo")


def test_ignore_eos_and_min_tokens_as_serving_benchmarks_send_them(fleet, tiny):
    """A bias of +100 on the end tokens ends the answer at once. ``min_tokens`` 5 keeps them out
    of the first five tokens (greedy decoding with them masked there, then the end token);
    ``ignore_eos`` makes the answer run to ``max_tokens``, as vLLM's and SGLang's serving
    benchmarks ask (completions, streamed, ``ignore_eos`` sent even when false)."""
    model, tok, _ = tiny
    messages = [{"role": "user", "content": "Say something."}]
    ids = tok.encode_chat(messages)
    client = openai_client(fleet)
    ends = {str(t): 100 for t in tok.stop_token_ids}

    def oracle(prompt: list[int], n: int, min_tokens: int) -> list[int]:
        out = []
        with torch.no_grad():
            for _ in range(n):
                row = model(torch.tensor([prompt + out])).logits[0, -1].float()
                row[list(tok.stop_token_ids)] += 100.0
                if len(out) < min_tokens:
                    row[list(tok.stop_token_ids)] = float("-inf")
                out.append(int(row.argmax()))
                if out[-1] in tok.stop_token_ids:
                    break
        return out

    body = {"model": "tiny-v1", "messages": messages, "max_tokens": 12, "temperature": 0, "logit_bias": ends}
    plain = client.chat.completions.create(**body)
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    want = oracle(ids, 12, 5)
    assert len(want) == 6 and want[-1] in tok.stop_token_ids
    for stream in (False, True):
        res = client.chat.completions.create(**body, stream=stream, extra_body={"min_tokens": 5},
                                             **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(res) if stream else [res]
        text = "".join((c.choices[0].delta.content or "") if stream else c.choices[0].message.content
                       for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text == tok.decode(want[:-1]) and usage.completion_tokens == 6
    prompt = [5, 17, 99, 3, 250]
    for stream in (False, True):
        res = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=7, temperature=0, logit_bias=ends,
                                        stream=stream, extra_body={"ignore_eos": True},
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(res) if stream else [res]
        assert chunks[-1].usage.completion_tokens == 7
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    off = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=7, temperature=0, logit_bias=ends,
                                    extra_body={"ignore_eos": False})
    assert off.usage.completion_tokens == 1 and off.choices[0].finish_reason == "stop"
    for bad in ({"min_tokens": 13}, {"min_tokens": -1}, {"ignore_eos": "yes"}, {"min_p": 1.5},
                {"min_tokens": 2, "response_format": {"type": "json_object"}}):
        api_error(post_json(fleet, "/v1/chat/completions", {**body, **bad}), 400, param=next(iter(bad)))


def test_min_p_one_samples_the_greedy_answer(fleet, tiny):
    """``min_p`` 1 keeps only the most probable token: a sample at temperature 1 is the greedy
    answer (the tiny model has no exact ties), while the same seed without it is not."""
    model, tok, _ = tiny
    messages = [{"role": "user", "content": "Say something."}]
    want = expected(model, tok, tok.encode_chat(messages), 16)
    client = openai_client(fleet)
    body = {"model": "tiny-v1", "messages": messages, "max_tokens": 16, "temperature": 1.0, "seed": 3}
    res = client.chat.completions.create(**body, extra_body={"min_p": 1.0})
    assert res.choices[0].message.content == tok.decode(want)
    assert client.chat.completions.create(**body).choices[0].message.content != tok.decode(want)


def test_stop_token_ids_end_the_answer_at_them(fleet, tiny):
    """vLLM's ``stop_token_ids``: the answer ends at the first of them (included, its text too:
    not a special token); with ``min_tokens`` not before it; an id outside the vocabulary is a
    400."""
    model, tok, _ = tiny
    prompt = [5, 17, 99, 3, 250]
    want = expected(model, tok, prompt, 16)
    stop = next(t for t in want[3:] if t not in want[:3] and t < tok.vocab_size)
    at = want.index(stop)
    client = openai_client(fleet)
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    res = client.completions.create(**body, extra_body={"stop_token_ids": [stop]})
    assert res.choices[0].text == tok.decode(want[:at + 1]) and res.usage.completion_tokens == at + 1
    assert res.choices[0].finish_reason == "stop"
    from tests.test_min_tokens import masked_greedy

    late = masked_greedy(model, prompt, 16, {stop, *tok.stop_token_ids}, at + 1)
    assert late != want[:at + 1]
    res = client.completions.create(**body, extra_body={"stop_token_ids": [stop], "min_tokens": at + 1})
    assert res.choices[0].text == tok.decode(late) and res.usage.completion_tokens == len(late)
    api_error(post_json(fleet, "/v1/completions", {**body, "stop_token_ids": [tok.vocab_size]}), 400,
              param="stop_token_ids")


def test_a_predicted_output_never_changes_the_answer(fleet, tiny):
    """OpenAI's ``prediction`` with the official client: the answer is the target's greedy one
    whatever is predicted (right, a word changed, wrong), and ``usage.completion_tokens_details``
    counts the prediction's tokens it took up (``followed``) and the rest. (The rounds it saves: tests/
    test_prediction.py on token ids; the tiny model's answers hold ids its tokenizer cannot
    spell, so their text does not tokenize back into them.)"""
    from specsplit.proposers.prediction import followed

    model, tok, _ = tiny
    client = openai_client(fleet)
    for content, predicted in (("Predict this.", lambda w: w),
                               ("Predict that.", lambda w: w[:len(w) // 2] + " zebra " + w[len(w) // 2:]),
                               ("Predict something.", lambda w: "Something else entirely.")):
        messages = [{"role": "user", "content": content}]
        want = tok.decode(expected(model, tok, tok.encode_chat(messages), 48))
        res = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=48, temperature=0,
                                             prediction={"type": "content", "content": predicted(want)})
        assert res.choices[0].message.content == want, content
        # OpenAI's usage details: the prediction's tokens the answer took up, and the others
        pred = tok.encode_text(predicted(want))
        took = followed(pred, expected(model, tok, tok.encode_chat(messages), 48))
        details = res.usage.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (took, len(pred) - took)
        assert took > 0 or content == "Predict something.", (content, took)
    body = {"model": "tiny-v1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    api_error(post_json(fleet, "/v1/chat/completions", {**body, "prediction": {"type": "text", "content": "x"}}), 400,
              param="prediction")
