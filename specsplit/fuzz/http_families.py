"""HTTP fuzzer, part 2: the case families (``FAMILIES``: name -> (weight, builder)) and the
seeded generator over them. Each builder makes one ``HttpCase`` from the generator's per-case
random source; a new family is one function plus its line in ``FAMILIES``."""

from __future__ import annotations

import copy
import random

from specsplit.fuzz.http_cases import (
    BAD_VALUES, CHAT, DELETE, HTTPX, Builder, Draft, HttpCase, encode, message_fields, raw_request, response_fields,
    schema_fields, set_path,
)
from specsplit.fuzz.http_wire import bad_headers, disconnect, method_path, slow, stream_cut, truncated

NUMBER_LITERALS = ("1e999", "-1e999", "1" + "0" * 5000, "1e-999", "0." + "0" * 5000 + "1", "9" * 400, "-0", "1E400",
                   "123456789012345678901234567890", "-9223372036854775809")
NUMERIC_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "frequency_penalty", "logprobs",
                  "min_tokens", "min_p")
BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xe9", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80")
SURROGATE_UTF8 = b"\xed\xa0\x80"  # U+D800 as UTF-8 would spell it: json.loads reads it as a lone surrogate
MARK = "@@fuzz@@"


# ------------------------------------------------------------------------------ body families
def valid(g: Builder, i: int) -> HttpCase:
    if g.rng.random() < 0.15:
        path, shape = g.rng.choice([("/v1/models", "json"), ("/health", "json"), ("/metrics", "text"),
                                    ("/v1/models?x=1", "json")])
        return HttpCase(i, "valid/get", HTTPX, "GET", path, expect=frozenset({200}), shape=shape)
    kind = g.rng.random()
    d = g.request() if kind < 0.7 else g.responses() if kind < 0.85 else g.messages()
    return g.httpx_case(i, f"valid/{d.shape}", d)


def wrong_type(g: Builder, i: int) -> HttpCase:
    kind = g.rng.random()
    chat = kind < 0.35
    d = g.chat() if chat else g.completion() if kind < 0.7 else g.responses() if kind < 0.85 else g.messages()
    path = g.rng.choice(schema_fields(chat) if kind < 0.7 else response_fields() if kind < 0.85 else message_fields())
    set_path(d.obj, path, DELETE if g.rng.random() < 0.1 else copy.deepcopy(g.rng.choice(BAD_VALUES)))
    d.expect, d.choices = {200, 400, 404}, 0
    return g.httpx_case(i, f"wrong_type/{path}", d)


def unknown_field(g: Builder, i: int) -> HttpCase:
    if g.rng.random() < 0.1:  # the Messages API's
        d = g.messages()
        name = g.rng.choice(["bogus", "", "Model", "n", "prompt", "max_completion_tokens", "input", "stream_options"])
        d.obj[name] = copy.deepcopy(g.rng.choice(BAD_VALUES))
        d.expect = {400}
        return g.httpx_case(i, "unknown_field/messages", d)
    if g.rng.random() < 0.2:  # the Responses API's: its items keep what clients echo back (ids, status)
        d = g.responses()
        d.obj[g.rng.choice(["bogus", "", "x" * 300, "Model", "n", "messages", "max_tokens", "stream_options "])] = \
            copy.deepcopy(g.rng.choice(BAD_VALUES))
        d.expect = {400}
        return g.httpx_case(i, "unknown_field/responses", d)
    chat = g.rng.random() < 0.5
    d = g.chat() if chat else g.completion()
    other = ["prompt", "echo", "suffix", "best_of"] if chat else ["messages", "max_completion_tokens", "tools"]
    name = g.rng.choice(["bogus", "", "x" * 300, "\ud800", "Model", "model ", "n\u0000", "é", *other])
    where = g.rng.choice(["", "", "stream_options", *(["messages.0", "messages.0.content.0"] if chat else [])])
    value = copy.deepcopy(g.rng.choice(BAD_VALUES))
    if where == "stream_options":
        d.obj["stream"] = True
        target = d.obj.setdefault("stream_options", {})
    elif where:
        if where.endswith("content.0"):
            set_path(d.obj, "messages.0.content.0.type", "text")
        target = d.obj["messages"][0] if where == "messages.0" else d.obj["messages"][0]["content"][0]
    else:
        target = d.obj
    target[name] = value
    d.expect = {400}
    return g.httpx_case(i, f"unknown_field/{where or 'top'}", d)


def huge_field(g: Builder, i: int) -> HttpCase:
    chat = g.rng.random() < 0.4
    d = g.chat() if chat else g.completion()
    variant = g.rng.choice(["model", "user", "text", "stop_list", "stop_string", "budget", "n", "token_ids", "seed",
                            "logit_bias", "array", "array"])
    body, r = d.obj, g.rng
    d.expect, d.choices = {400}, 0
    if variant in ("model", "user"):
        body[variant] = variant[0] * r.choice([257, 1000, 20000])
    elif variant == "text":
        text = long_text(r, r.choice([3000, 20000, int(g.max_body * 0.9)]))
        set_path(body, "messages.0.content" if chat else "prompt", text)
        d.expect = {200, 400}
    elif variant in ("stop_list", "stop_string"):
        body["stop"] = (["s"] * r.choice([17, 100, 3000]) if variant == "stop_list"
                        else ["s" * r.choice([1025, 5000, 40000])])
    elif variant == "budget":
        value = r.choice([2**20, 2**31, 2**63, 2**64, 10**40])
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = value
    elif variant == "n":
        body["n"] = r.choice([16, 17, 1000, 2**31, 2**64])
        if body["n"] == 16:  # the most choices a request may ask for: one prompt, 16 sessions
            set_path(body, "messages.0.content" if chat else "prompt", g.text())
            d.expect, d.choices = {200}, 16
    elif variant == "seed":
        body["seed"] = r.choice([2**64, -(2**63) - 1, 2**200])
    elif variant == "token_ids":
        bad = r.choice([2**20, 2**31, 2**63, 2**64 - 1, 2**64, -1, -(2**63), 10**30])
        ids = g.ids()
        ids.insert(r.randrange(len(ids) + 1), bad)
        set_path(body, "messages.0.content" if chat else "prompt", ids if chat or r.random() < 0.5 else [g.ids(), ids])
    elif variant == "logit_bias":  # over 300 tokens, or a key that is no token id
        body["logit_bias"] = r.choice([{str(j): 1 for j in range(r.choice([301, 1000, 10000]))}, {"-1": 1},
                                       {"x": 1}, {str(10**9): 1}, {"3": 101}])
    else:
        return near_limit(g, i, d, chat)
    return g.httpx_case(i, f"huge_field/{variant}", d)


def long_text(r: random.Random, chars: int) -> str:
    words = [r.choice(("the", "cat", "sat", "é", "日本", "🙂", "\n")) for _ in range(chars // 3 + 1)]
    return " ".join(words)[:chars]


def near_limit(g: Builder, i: int, d: Draft, chat: bool) -> HttpCase:
    """An array that makes the body a few bytes under or over the body limit."""
    r, body = g.rng, d.obj
    field, item = ("messages", {"role": "user", "content": "x"}) if chat else r.choice(
        [("prompt", 7), ("stop", "s")])
    body[field] = [item]
    base, per = len(encode(body)), len(encode(item)) + 1
    target = g.max_body + r.choice([-40, -3, -1, 0, 1, 2, 40, 4096])
    body[field] = [item] * max(1, (target - base) // per + 1)
    d.expect = {200, 400}
    return g.httpx_case(i, f"huge_field/array_{field}", d)


# ------------------------------------------------------------------------------ raw JSON
def malformed_json(g: Builder, i: int) -> HttpCase:
    d = g.request()
    variant = g.rng.choice(["truncated", "garbage", "flipped", "bad_utf8", "surrogate", "encoding", "deep", "deep",
                            "number", "nan", "non_object", "empty", "trailing", "duplicate"])
    body, expect = MALFORMED[variant](g, d)
    shaped = Draft(d.path, expect=expect, shape=d.shape if 200 in expect else "", choices=0)
    return g.raw_case(i, f"malformed_json/{variant}", shaped, [("send", raw_request("POST", d.path, body))],
                      body=body)


def _truncated(g, d):
    data = d.data()
    return data[:g.rng.randrange(len(data))], {400}


def _garbage(g, d):
    return g.rng.randbytes(g.rng.randint(1, 200)), {400}


def _flipped(g, d):
    data = bytearray(d.data())
    for _ in range(g.rng.randint(1, 3)):
        data[g.rng.randrange(len(data))] ^= 1 << g.rng.randrange(8)
    return bytes(data), {200, 400, 404}


def _marked(g, d, chat_field: str = "messages.0.content") -> tuple[dict, str]:
    """The body with MARK in a string field (or a key) chosen at random, and which."""
    body = copy.deepcopy(d.obj)
    where = g.rng.choice(["user", "model", "stop", "key", chat_field if d.path == CHAT else "prompt"])
    if where == "key":
        body[MARK] = 1
    else:
        set_path(body, where, MARK)
    return body, where


def _bad_utf8(g, d):
    body, _ = _marked(g, d)
    return encode(body).replace(MARK.encode(), g.rng.choice(BAD_UTF8)), {400}


def _surrogate(g, d):
    body, _ = _marked(g, d)
    # a prompt or message that is no text is a 400; elsewhere the string may pass (or the model 404)
    return encode(body).replace(MARK.encode(), SURROGATE_UTF8), {200, 400, 404}


def _encoding(g, d):
    return json_text(d).encode(g.rng.choice(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "utf-16-be"])), {200, 400}


def json_text(d: Draft) -> str:
    return encode(d.obj, ensure_ascii=True).decode("ascii")


def _deep(g, d):
    depth = g.rng.choice([100, 1000, 5000, 20000, g.max_body // 2])
    form = g.rng.choice(["array", "object", "prompt", "content"])
    if form == "array":
        return b"[" * depth + b"]" * depth, {400}
    if form == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth, {400}
    body = copy.deepcopy(d.obj)
    set_path(body, "messages.0.content" if d.path == CHAT and form == "content" else "prompt", MARK)
    return encode(body).replace(f'"{MARK}"'.encode(), b"[" * depth + b"]" * depth), {400}


def _number(g, d):
    body = copy.deepcopy(d.obj)
    name = g.rng.choice([*NUMERIC_FIELDS, "prompt"])
    body[name] = [5, MARK] if name == "prompt" else MARK
    literal = g.rng.choice(NUMBER_LITERALS).encode()
    return encode(body).replace(f'"{MARK}"'.encode(), literal), {200, 400}


def _nan(g, d):
    body = copy.deepcopy(d.obj)
    name = g.rng.choice([*NUMERIC_FIELDS, "prompt", "stop", "user", "stream"])
    body[name] = [5, MARK] if name == "prompt" else MARK
    return encode(body).replace(f'"{MARK}"'.encode(), g.rng.choice([b"NaN", b"Infinity", b"-Infinity"])), {400}


def _non_object(g, d):
    return g.rng.choice([b"[]", b'"x"', b"1", b"null", b"true", b"[{}]", b"{}"]), {400}


def _empty(g, d):
    return g.rng.choice([b"", b" ", b"\n\t", b"\x00"]), {400}


def _trailing(g, d):
    tail = g.rng.choice([b"x", b"}", b",{}", b"\x00", b" \n", b"\r\n\r\n"])
    return d.data() + tail, ({200} if not tail.strip() else {400})


def _duplicate(g, d):
    extra, expect = g.rng.choice([(b'"model":"nope"', {404}), (b'"max_tokens":"x"', {400}), (b'"n":1', {200}),
                                  (b'"stream":false', {200, 400})])  # 400 where stream_options came too
    data = d.data()
    return data[:-1] + b"," + extra + b"}", expect


MALFORMED = {"truncated": _truncated, "garbage": _garbage, "flipped": _flipped, "bad_utf8": _bad_utf8,
             "surrogate": _surrogate, "encoding": _encoding, "deep": _deep, "number": _number, "nan": _nan,
             "non_object": _non_object, "empty": _empty, "trailing": _trailing, "duplicate": _duplicate}

LLAMA_FIELDS = {  # llama-server's fields (specsplit.api.llama_server), with values it may take or refuse
    "n_predict": [-1, 0, 1, 3], "temperature": [0, 0.8, 1.5], "top_k": [0, 1, 40], "top_p": [0.5, 0.95, 1.0],
    "min_p": [0, 0.05], "seed": [-1, 7], "stop": [["\n"], ["x", "y"]], "n_indent": [0, 2, 4],
    "t_max_predict_ms": [0, 1, 500], "samplers": [["top_k", "top_p", "infill"], "kpmt", ["min_p", "top_p"], ["?"]],
    "response_fields": [["content"], ["timings/prompt_n", "nothing/here"]], "return_tokens": [True],
    "id_slot": [0, -1], "cache_prompt": [True, False], "repeat_penalty": [1.0, 1.1], "n_probs": [0, 2],
    "logit_bias": [[[5, 1.0]], {"7": False}, [["é", -1]]], "input_extra": [[{"text": "x = 1\n"}], [{"fn": 1}]],
    "n_cmpl": [1, 2], "mirostat": [0, 2],
}


def llama_native(g: Builder, i: int) -> HttpCase:
    """llama-server's /completion and /infill: a few of its fields at values it takes or refuses,
    now and then one of them wrong (a 200 or a 400, never anything else)."""
    r = g.rng
    infill = r.random() < 0.5
    body: dict = {"input_prefix": g.text(), "input_suffix": g.text(), "prompt": g.text()} if infill else \
        {"prompt": r.choice([g.text(), g.ids(1, 8), [g.text(), *g.ids(1, 3)], [g.text(), g.text()]])}
    body["n_predict"] = r.randint(1, 4)
    for name in r.sample(sorted(LLAMA_FIELDS), r.randint(0, 4)):
        body[name] = copy.deepcopy(r.choice(LLAMA_FIELDS[name]))
    if r.random() < 0.25:
        body[r.choice(sorted(body))] = copy.deepcopy(r.choice(BAD_VALUES))
    if isinstance(body.get("n_predict"), int) and not 0 <= body["n_predict"] <= 4:
        body["n_predict"] = 4  # (a bounded answer: the case's time bound is the short one)
    body["stream"] = r.random() < 0.3
    d = Draft("/infill" if infill else "/completion", body, expect={200, 400}, shape="", choices=0)
    return g.httpx_case(i, f"llama/{'infill' if infill else 'completion'}", d)


def surrogate_text(g: Builder, i: int) -> HttpCase:
    """A lone surrogate in a text of a Responses API, Messages API or llama-server body: what a tokenizer reads
    or an answer echoes (instructions, user, metadata) can hold none, so each is a 400."""
    r = g.rng
    kind = r.random()
    if kind < 0.45:
        d = g.responses(stream=r.random() < 0.3)
        where = r.choice(["user", "instructions", "metadata.k", "input", "input.0.content", "model", "stop",
                          "prompt_cache_key", "safety_identifier", "key"])
    elif kind < 0.7:
        d = g.messages(stream=r.random() < 0.3)
        where = r.choice(["system", "messages.0.content", "metadata.user_id", "model", "stop_sequences", "key",
                          "inference_geo"])
    else:
        d = Draft("/completion", {"prompt": g.text(), "n_predict": 2}, shape="")
        where = r.choice(["prompt", "prompt.1", "input_extra.0.text", "input_extra.0.filename", "stop.0", "key"])
    body = copy.deepcopy(d.obj)
    if where == "key":
        body[MARK] = 1
    else:
        set_path(body, where, MARK)
    data = encode(body).replace(MARK.encode(), SURROGATE_UTF8)
    shaped = Draft(d.path, expect={400}, choices=0)
    return g.raw_case(i, f"surrogate/{d.path.strip('/').replace('/', '_')}", shaped,
                      [("send", raw_request("POST", d.path, data))], body=data)


FAMILIES = {
    "valid": (14, valid), "wrong_type": (20, wrong_type), "unknown_field": (5, unknown_field),
    "huge_field": (12, huge_field), "malformed_json": (16, malformed_json), "method_path": (8, method_path),
    "bad_headers": (12, bad_headers), "slow": (4, slow), "truncated": (3, truncated), "disconnect": (3, disconnect),
    "stream_cut": (3, stream_cut), "llama": (6, llama_native), "surrogate": (3, surrogate_text),
}


class HttpGenerator(Builder):
    def case(self, index: int) -> HttpCase:
        """Case ``index``: the same for the same seed, whatever was generated before."""
        self.rng = random.Random(f"{self.seed}/{index}")
        names = list(FAMILIES)
        name = self.rng.choices(names, [FAMILIES[n][0] for n in names])[0]
        return FAMILIES[name][1](self, index)
