"""The fuzzer's HTTP target: seeded malformed, hostile and valid requests against ``specsplit
api`` on 127.0.0.1, and what the API and the fleet behind it must still do afterwards.

``http_fuzz(url, seed, count, limits)`` sends ``count`` cases (``http_families``; case ``i`` is
rebuilt alone from (seed, i)) over at most ``window`` connections at once, each case bounded by
its own deadline and the run by ``deadline_s``, and judges each (``http_run.judge``): a status in
the documented set and the case's own, OpenAI's error body, never 500, never a hang, a closed
connection only where the case is slow, truncated or hung up. ``fuzz_api`` wraps it: greedy
answers to fixed token-id prompts before, the fuzz, then /health 200, no request left running
or waiting (GET /metrics) and no 500 counted within ``settle_s``, and the same greedy answers.

Worked example: ``python -m specsplit.fuzz --target http --url http://127.0.0.1:8000 --seed 7``
against ``honcho start``; a failure names its case, e.g. ``--case 123`` reruns that one alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from specsplit.fuzz.http_cases import RAW, HttpCase
from specsplit.fuzz.http_families import HttpGenerator
from specsplit.fuzz.http_run import Outcome, judge, run_httpx, run_raw

GUARD_S = 15.0  # past a case's own bound, the runner gives up on it (the judge already failed it)
REFERENCE_PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79], [2, 7, 1, 8, 2, 8], [100, 200, 300, 42], [5, 17, 99, 3, 250])
REFERENCE_TOKENS = 16


@dataclass(frozen=True)
class ApiLimits:
    """The limits of the API under test (its settings): the cases are sized from them."""

    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float

    @classmethod
    def of(cls, settings) -> ApiLimits:
        return cls(settings.api_max_body_bytes, settings.api_header_timeout_s, settings.api_body_timeout_s)


@dataclass
class HttpReport:
    seed: int
    count: int
    sent: Counter = field(default_factory=Counter)  # by family
    outcomes: Counter = field(default_factory=Counter)  # by status, or closed / hung_up / timed_out
    problems: Counter = field(default_factory=Counter)  # "family: problem" -> cases
    first: dict[str, str] = field(default_factory=dict)  # "family: problem" -> its first case, reproducible
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def failures(self) -> list[str]:
        return [f"{n} x {sig}; first: {self.first[sig]}" for sig, n in self.problems.most_common()] + self.notes

    def add(self, case: HttpCase, out: Outcome, problems: list[tuple[str, str]]) -> None:
        self.sent[case.family.split("/")[0]] += 1
        kind = ("hung_up" if out.hung_up and out.status is None else "timed_out" if out.timed_out
                else "closed" if out.status is None else str(out.status))
        if kind == "closed" and not case.may_close:
            kind = "closed_headers_late"  # judged: the header timeout may have closed it (``judge``)
        self.outcomes[kind] += 1
        for problem, detail in problems:
            sig = f"{case.family}: {problem}"
            self.problems[sig] += 1
            self.first.setdefault(sig, f"case {case.index} (seed {self.seed}): {detail}\n    {case.reproducer()}")

    def summary(self) -> str:
        return (f"seed={self.seed} sent={self.total}/{self.count} {dict(self.sent)} outcomes={dict(self.outcomes)} "
                f"failing_cases={sum(self.problems.values())} kinds={len(self.problems)} "
                f"elapsed_s={self.elapsed_s:.1f}")


def loopback(url: str) -> tuple[str, int, str]:
    """(host, port, base url) of ``url``; ValueError unless it is http://127.0.0.1:PORT."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or not parts.port:
        raise ValueError(f"the HTTP fuzzer only targets http://127.0.0.1:PORT, not {url!r}")
    return parts.hostname, parts.port, f"http://127.0.0.1:{parts.port}"


async def run_case(client: httpx.AsyncClient, host: str, port: int, base: str, case: HttpCase) -> Outcome:
    try:
        if case.transport == RAW:
            coro = run_raw(host, port, case)
        else:
            coro = run_httpx(client, base, case)
        return await asyncio.wait_for(coro, case.bound_s + GUARD_S)
    except TimeoutError:
        return Outcome(timed_out=True, elapsed_s=case.bound_s + GUARD_S)
    except OSError as exc:  # connecting failed: the server is gone
        return Outcome(closed=True, error=f"could not connect: {exc!r}")


async def _fuzz(url: str, cases: list[HttpCase], report: HttpReport, header_timeout_s: float, window: int,
                deadline_s: float) -> None:
    host, port, base = loopback(url)
    deadline = time.monotonic() + deadline_s
    slots = asyncio.Semaphore(window)
    limits = httpx.Limits(max_connections=window * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        async def one(case: HttpCase) -> None:
            try:
                out = await run_case(client, host, port, base, case)
                report.add(case, out, judge(case, out, header_timeout_s))
            finally:
                slots.release()

        tasks = []
        for case in cases:
            await slots.acquire()
            if time.monotonic() > deadline:
                slots.release()
                report.notes.append(f"deadline of {deadline_s:.0f} s passed after {len(tasks)} of {len(cases)} cases")
                break
            tasks.append(asyncio.ensure_future(one(case)))
        await asyncio.gather(*tasks)


def http_fuzz(url: str, seed: int, count: int, limits: ApiLimits, *, model: str | None = None, window: int = 16,
              deadline_s: float = 600.0, cases: list[int] | None = None) -> HttpReport:
    """Fuzz the API at ``url`` with cases 0..count-1 of ``seed`` (or only ``cases``)."""
    loopback(url)
    model = model or served_model(url)
    gen = HttpGenerator(seed, model=model, max_body=limits.max_body_bytes, header_timeout_s=limits.header_timeout_s,
                        body_timeout_s=limits.body_timeout_s)
    indices = list(cases) if cases is not None else list(range(count))
    built = [gen.case(i) for i in indices]  # before sending: no case waits on its generation
    report = HttpReport(seed, len(indices))
    t0 = time.monotonic()
    asyncio.run(_fuzz(url, built, report, limits.header_timeout_s, window, deadline_s))
    report.elapsed_s = time.monotonic() - t0
    return report


# ---------------------------------------------------------------------------------- before and after
def served_model(url: str) -> str:
    resp = httpx.get(f"{loopback(url)[2]}/v1/models", timeout=30)
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered {resp.status_code}: {resp.text[:300]} (the fuzzer needs an API "
                           "without keys, serving)")
    return resp.json()["data"][0]["id"]


def greedy_texts(url: str, model: str) -> list[str]:
    """The API's greedy (temperature 0) answers to the fixed token-id prompts."""
    base, out = loopback(url)[2], []
    with httpx.Client(timeout=120) as client:
        for prompt in REFERENCE_PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": REFERENCE_TOKENS, "temperature": 0}
            resp = client.post(f"{base}/v1/completions", json=body)
            resp.raise_for_status()
            out.append(resp.json()["choices"][0]["text"])
    return out


def metrics(url: str) -> dict[str, float]:
    from specsplit.launch import scrape

    return scrape(f"{loopback(url)[2]}/metrics", timeout_s=5)


def server_errors(m: dict[str, float]) -> dict[str, float]:
    """Answers the API counted with a 5xx status other than 503, by route and status."""
    return {k: v for k, v in m.items() if k.startswith("specsplit:http_responses_total") and 'status="5' in k
            and 'status="503"' not in k}


def settle_problems(url: str, settle_s: float, errors_before: dict[str, float]) -> list[str]:
    """What is still wrong ``settle_s`` after the fuzz: /health, requests running or waiting, and
    5xx answers (other than 503) the API counted since ``errors_before``."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            health = httpx.get(f"{loopback(url)[2]}/health", timeout=5)
            m = metrics(url)
        except (httpx.HTTPError, OSError) as exc:
            why, m = [f"the API does not answer: {exc!r}"], {}
        else:
            why = [f"/health answers {health.status_code}: {health.text[:200]}"] if health.status_code != 200 else []
            why += [f"{name} is {m.get(name)} (not back to 0)" for name in
                    ("specsplit:num_requests_running", "specsplit:num_requests_waiting") if m.get(name) != 0]
        if not why or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    new = {k: v - errors_before.get(k, 0) for k, v in server_errors(m).items() if v > errors_before.get(k, 0)}
    return why + ([f"the API counted new answers of status 5xx other than 503: {new}"] if new else [])


@dataclass
class ApiFuzz:
    report: HttpReport
    before: list[str]
    after: list[str]
    problems: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.report.failures


def fuzz_api(url: str, seed: int, count: int, limits: ApiLimits, *, window: int = 16, deadline_s: float = 600.0,
             settle_s: float = 10.0, cases: list[int] | None = None) -> ApiFuzz:
    """Greedy answers, the fuzz, then the API and the fleet checked (see the module docstring)."""
    t0 = time.monotonic()
    model = served_model(url)
    before = greedy_texts(url, model)
    errors_before = server_errors(metrics(url))
    report = http_fuzz(url, seed, count, limits, model=model, window=window, deadline_s=deadline_s, cases=cases)
    t1 = time.monotonic()
    problems = settle_problems(url, settle_s, errors_before)
    timings = {"fuzz_s": round(t1 - t0, 1), "settle_s": round(time.monotonic() - t1, 1)}
    try:
        after = greedy_texts(url, model)
    except httpx.HTTPError as exc:
        after = []
        problems.append(f"the greedy requests failed after the fuzz: {exc!r}")
    if after and after != before:
        problems.append(f"greedy answers changed by the fuzz: {before} -> {after}")
    timings["total_s"] = round(time.monotonic() - t0, 1)
    return ApiFuzz(report, before, after, problems, timings)
