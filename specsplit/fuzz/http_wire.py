"""HTTP fuzzer, part 3: the families below the JSON: wrong methods and paths, bad headers
(Content-Length, chunked bodies, Content-Type, Authorization, header syntax, HTTP versions), slow
headers and bodies, truncated bodies, hang-ups mid-request and mid-generation, streams cut after
a few events. Raw cases are the exact bytes on the socket (``HttpCase.steps``)."""

from __future__ import annotations

from specsplit.fuzz.http_cases import (
    CHAT, COMPLETIONS, HTTPX, LONG_BOUND_S, RESPONSES, SLACK_S, STREAM_CUT, Builder, Draft, HttpCase, raw_request,
)

GET_ROUTES = ("/v1/models", "/health", "/metrics")
POST_ROUTES = (COMPLETIONS, CHAT, RESPONSES)
WRONG_PATHS = ("/", "/v1", "/v1/", "/v1/completion", "/v1/chat", "/v1/chat/completion", "/v2/completions",
               "/V1/models", "/v1/modelsx", "/v1/embeddings", "/v1/completions/", "/v1/chat/completions/",
               "/health/", "/metrics/x", "/v1/model", "/favicon.ico", "/v1/completions/x", "/v1/response",
               "/v1/responses/", "/v1/responses/x/y")
ODD_TARGETS = ("//v1/models", "/v1/%6Dodels", "/%00", "/%ff", "/v1/models%2f", "*", "http://127.0.0.1/v1/models",
               "/v1/models#frag", "/v1/../v1/models", "/v1/models?" + "q=1&" * 1000, "/%2e%2e/health")
AUTHORIZATIONS = ("Bearer", "Bearer ", "Basic Zm9vOmJhcg==", "Bearer " + "k" * 8000, "bearer sk-x", "Bearer a b c",
                  "Bearer \xe9\xff", "")
CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "garbage", "application/json" * 100)
SAFE_HEADERS = ["Content-Type: application/json"]


def method_path(g: Builder, i: int) -> HttpCase:
    r = g.rng
    variant = r.choice(["method", "method", "path", "path", "odd_target", "odd_method"])
    if variant == "method":
        path = r.choice(GET_ROUTES + POST_ROUTES)
        if path in POST_ROUTES:
            method, expect = r.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]), {405}
        else:
            method = r.choice(["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
            expect = {200} if method == "HEAD" else {405}
        body = g.request().data() if method not in ("GET", "HEAD", "OPTIONS") else b""
        return HttpCase(i, f"method_path/{method}", HTTPX, method, path, (), body, expect=frozenset(expect))
    if variant == "path":
        path = r.choice((*WRONG_PATHS, "/v1/" + "a" * r.choice([10, 1000, 8000])))
        method = r.choice(["GET", "POST"])
        body = g.request().data() if method == "POST" else b""
        return HttpCase(i, "method_path/path", HTTPX, method, path, (), body, expect=frozenset({404}))
    if variant == "odd_target":
        target = r.choice(ODD_TARGETS)
        data = raw_request("GET", target, b"", headers=[])
        return g.raw_case(i, "method_path/odd_target", Draft("", expect={200, 400, 404}), [("send", data)])
    method = r.choice(["FOO", "get", "PROPFIND", "TRACE", "CONNECT", "M-SEARCH", "POST POST"])
    data = raw_request(method, r.choice(GET_ROUTES + POST_ROUTES), g.request().data())
    return g.raw_case(i, "method_path/odd_method", Draft("", expect={400, 405}), [("send", data)])


def bad_headers(g: Builder, i: int) -> HttpCase:
    d = g.request()
    variant = g.rng.choice(["content_length", "content_length", "chunked", "chunked", "content_type", "authorization",
                            "syntax", "version", "expect"])
    data, expect = WIRE[variant](g, d)
    shaped = Draft(d.path, expect=expect, shape=d.shape if 200 in expect else "", choices=d.choices)
    return g.raw_case(i, f"bad_headers/{variant}", shaped, [("send", data)])


def _content_length(g, d):
    body, n = d.data(), len(d.data())
    value, expect = g.rng.choice([
        ("abc", {400}), ("-1", {400}), ("+5", {400}), ("0x10", {400}), ("1.0", {400}), ("", {400}),
        (f"{n}, {n}", {200, 400}), (f"{n}, {n + 1}", {400}), (str(n - 1 - g.rng.randrange(n - 1)), {400}),
        ("0", {400}), (str(g.max_body + 1), {413}), ("9" * 30, {400, 413}), (f" {n} ", {200}),
    ])
    headers = [*SAFE_HEADERS, f"Content-Length: {value}"]
    if g.rng.random() < 0.2:  # a second Content-Length: the same value may be accepted, another never
        second = n if g.rng.random() < 0.5 else n + 7
        headers.append(f"Content-Length: {second}")
        same = {v.strip() for v in value.split(",")} == {str(second)}
        expect = expect | {400} if same else {400}
    return raw_request("POST", d.path, body, headers), expect


def chunked(body: bytes, r, ext: str = "", upper: bool = False, trailer: str = "") -> bytes:
    out, pos = [], 0
    while pos < len(body):
        size = min(len(body) - pos, r.choice([1, 7, 100, 4096]))
        out.append((f"{size:X}" if upper else f"{size:x}").encode() + ext.encode() + b"\r\n" + body[pos:pos + size]
                   + b"\r\n")
        pos += size
    return b"".join(out) + b"0\r\n" + trailer.encode() + b"\r\n"


def _chunked(g, d):
    r, body = g.rng, d.data()
    te = ["Transfer-Encoding: chunked"]
    variant = r.choice(["plain", "ext", "upper", "trailer", "bad_size", "short", "over", "with_length", "odd_te"])
    if variant in ("plain", "ext", "upper", "trailer"):
        return raw_request("POST", d.path, chunked(body, r, ";a=b" if variant == "ext" else "", variant == "upper",
                                                   "X-T: 1\r\n" if variant == "trailer" else ""),
                           [*SAFE_HEADERS, *te]), {200}
    if variant == "bad_size":
        return raw_request("POST", d.path, b"zz\r\n" + body + b"\r\n0\r\n\r\n", [*SAFE_HEADERS, *te]), {400}
    if variant == "short":  # a chunk longer than declared
        return raw_request("POST", d.path, b"2\r\n" + body + b"\r\n0\r\n\r\n", [*SAFE_HEADERS, *te]), {400}
    if variant == "over":
        big = b'{"model":"x","prompt":"' + b"a" * (g.max_body + r.choice([1, 100, 5000])) + b'"}'
        return raw_request("POST", d.path, chunked(big, r), [*SAFE_HEADERS, *te]), {413}
    if variant == "with_length":
        return raw_request("POST", d.path, chunked(body, r), [*SAFE_HEADERS, *te, f"Content-Length: {len(body)}"]), \
            {200, 400}
    te = r.choice(["gzip", "chunked, gzip", "gzip, chunked", "Chunked", "chunked, chunked", "identity"])
    return raw_request("POST", d.path, chunked(body, r), [*SAFE_HEADERS, f"Transfer-Encoding: {te}"]), {200, 400}


def _content_type(g, d):
    body = d.data()
    ct = g.rng.choice((*CONTENT_TYPES, ""))
    headers = ([f"Content-Type: {ct}"] if ct else []) + [f"Content-Length: {len(body)}"]
    return raw_request("POST", d.path, body, headers), {200}


def _authorization(g, d):
    body = d.data()
    headers = [*SAFE_HEADERS, f"Content-Length: {len(body)}", f"Authorization: {g.rng.choice(AUTHORIZATIONS)}"]
    return raw_request("POST", d.path, body, headers), {200}


def _syntax(g, d):
    body = d.data()
    line, expect = g.rng.choice([
        ("NoColon", {400}), ("Bad Name: x", {400}), ("X-Nul: a\x00b", {400}), ("X-CR: a\rb", {400}),
        (": empty-name", {400}), ("X-Long: " + "a" * 20000, {200, 400}), ("\r\n".join(f"X-N{j}: v" for j in range(150)),
                                                                      {200}),
        ("X-Obs: \xe9\xff", {200}), ("X-Fold: a\r\n folded", {200, 400}), ("X-Empty:", {200}),
    ])
    return raw_request("POST", d.path, body, [*SAFE_HEADERS, line, f"Content-Length: {len(body)}"]), expect


def _version(g, d):
    body = d.data()
    version, host, expect = g.rng.choice([("HTTP/1.0", False, {200}), ("HTTP/1.1", False, {400}),
                                          ("HTTP/2.0", True, {200, 400}), ("http/1.1", True, {400}),
                                          ("HTTP/0.9", True, {200, 400}), ("HTTP/1.1 x", True, {400}),
                                          ("HTTP/1.2", True, {200, 400})])
    data = raw_request("POST", d.path, body, [*SAFE_HEADERS, f"Content-Length: {len(body)}"], version=version)
    if not host:
        data = data.replace(b"Host: 127.0.0.1\r\n", b"")
    return data, expect


def _expect(g, d):
    body = d.data()
    headers = [*SAFE_HEADERS, f"Content-Length: {len(body)}", g.rng.choice(["Expect: 100-continue", "Expect: x"])]
    return raw_request("POST", d.path, body, headers), {200, 400}


WIRE = {"content_length": _content_length, "chunked": _chunked, "content_type": _content_type,
        "authorization": _authorization, "syntax": _syntax, "version": _version, "expect": _expect}


# ------------------------------------------------------------------------------ time and hang-ups
def trickle_for(g: Builder, data: bytes, seconds: float) -> tuple[bytes, float]:
    """Part of ``data`` and an interval that trickle it over about ``seconds``."""
    interval = g.rng.choice([0.05, 0.1, 0.25])
    return data[:max(1, min(len(data) - 1, int(seconds / interval)))], interval


def slow(g: Builder, i: int) -> HttpCase:
    """Headers or a body trickled, then stalled: the server's header / body timeout must end it."""
    r, d = g.rng, g.request()
    data = raw_request("POST", d.path, d.data())
    head_end = data.index(b"\r\n\r\n") + 4
    if r.random() < 0.5:
        k = r.randrange(head_end - 3)
        part, interval = trickle_for(g, data[k:head_end - 3], r.uniform(0.2, 2.0) * g.header_timeout_s)
        steps = [("send", data[:k]), ("trickle", part, interval), ("sleep", 3 * g.header_timeout_s + SLACK_S)]
        bound = g.header_timeout_s + SLACK_S
        variant = "headers"
    else:
        if r.random() < 0.3:
            data = raw_request("POST", d.path, chunked(d.data(), r), [*SAFE_HEADERS, "Transfer-Encoding: chunked"])
        k = head_end + r.randrange(len(data) - head_end - 1)
        part, interval = trickle_for(g, data[k:-1], r.uniform(0.2, 2.0) * g.body_timeout_s)
        steps = [("send", data[:k]), ("trickle", part, interval), ("sleep", 3 * g.body_timeout_s + SLACK_S)]
        bound = g.body_timeout_s + SLACK_S
        variant = "body"
    return g.raw_case(i, f"slow/{variant}", Draft(d.path, expect={408}), steps, may_close=True, bound_s=bound)


def truncated(g: Builder, i: int) -> HttpCase:
    """A body shorter than announced (or a chunked one never ended), then a half-close."""
    r, d = g.rng, g.request()
    body = d.data()
    if r.random() < 0.5:
        data = raw_request("POST", d.path, body, [*SAFE_HEADERS, f"Content-Length: {len(body) + r.randint(1, 5000)}"])
    else:
        data = raw_request("POST", d.path, chunked(body, r)[:-5], [*SAFE_HEADERS, "Transfer-Encoding: chunked"])
    end = r.choice(["eof", "eof", "hangup"])
    return g.raw_case(i, f"truncated/{end}", Draft(d.path, expect={400, 408}), [("send", data), (end,)],
                      may_close=True, bound_s=g.body_timeout_s + SLACK_S)


def disconnect(g: Builder, i: int) -> HttpCase:
    """Hang up mid-headers, mid-body, right after the request, or while it generates."""
    r = g.rng
    variant = r.choice(["headers", "body", "request", "generation", "generation"])
    d = g.request() if variant != "generation" else (g.completion if r.random() < 0.6 else g.chat)(
        stream=r.random() < 0.5, max_tokens=r.randint(200, 2000))
    data = raw_request("POST", d.path, d.data())
    head_end = data.index(b"\r\n\r\n") + 4
    cut = {"headers": r.randrange(1, head_end - 2), "body": r.randrange(head_end, len(data))}.get(variant, len(data))
    steps = [("send", data[:cut])]
    if variant == "generation":
        steps.append(("sleep", r.uniform(0.05, 0.6)))
    steps.append(("hangup",))
    return g.raw_case(i, f"disconnect/{variant}", Draft(d.path, expect={200}), steps, may_close=True,
                      bound_s=LONG_BOUND_S)


def stream_cut(g: Builder, i: int) -> HttpCase:
    """A long stream read for a few events, then the connection closed."""
    r = g.rng
    d = (g.completion if r.random() < 0.6 else g.chat)(stream=True, max_tokens=r.randint(100, 2000))
    case = g.httpx_case(i, f"stream_cut/{d.shape}", d)
    return HttpCase(i, case.family, STREAM_CUT, "POST", d.path, case.headers, case.body, expect=case.expect,
                    shape=d.shape, stream=True, choices=d.choices, events=r.randint(1, 6), bound_s=20.0)
