"""``specsplit bench api``: what the OpenAI-compatible HTTP API costs on top of the fleet's own
producer client, per request and in aggregate, on the same fleet in one run.

The fleet is started as people start it: ``honcho start`` with the repository's Procfile (its
``api`` line included) and .env (under the shell's settings), on free ports, one process per
line. Once GET /health answers 200, at each concurrency C the same prompts (HumanEval, chat
formatted as ``specsplit produce`` sends them) go through two doors, C requests in flight at once
(a new one starts when one finishes), greedy:

- **api**: the official ``openai`` client (``AsyncOpenAI``), streaming, with usage. By default
  ``/v1/chat/completions`` with the prompt as the user message (the API applies the same chat
  template); ``--endpoint completions`` sends the token ids produce would send to
  ``/v1/completions``.
- **producer**: ``specsplit.pool.OrchestratorPool``, as ``specsplit produce`` uses it.

The order alternates per level and, by default (``--aba``), the level's first door runs again
after the second (A B A), so a drift of the machine that is linear over the level weighs on both
doors alike; a door's figures at a level are the means of its passes (wall time, each request's
times). Every pass starts on a fresh orchestrator: its supervised child is killed and its
supervisor starts a new one on the same address, ready once both doors got a one-token answer
through it. The orchestrator's n-gram cache learns every answer and greedy decoding repeats
them, so a pass would otherwise draft what an earlier pass generated (``specsplit bench load``
measured what that does).

Per request, in seconds from its start: time to first token, timed at both doors as the first
text streamed (the API sends text; the producer's tokens go through the IncrementalDecoder that
the API and ``specsplit produce`` use, so a character whose bytes span tokens shows with its
last one; the producer's first token is in the JSON too), and time per output token after the
first, (end - first) / (tokens - 1), where end is when the answer ended (the API: the chunk with
its finish_reason, since an SSE chunk does not say how many tokens it carries and an end token
has no text; the producer: its GenerateDone). Aggregate tok/s: the level's new tokens / its wall
time. Greedy: each API answer must equal the producer's (text, token count, finish reason,
prompt tokens); the exit code is 1 when one does not, or a request failed.

    specsplit bench api --concurrency 1,4,16 --json runs/api.json          (writes runs/api.png)
    specsplit bench api --preset tiny --concurrency 1,2 --prompts 4 --max-new-tokens 8 --json /tmp/a.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from specsplit.bench.api_report import Answer, Pass, make_row, markdown, plot, summarize
from specsplit.bench.honcho import REPO, HonchoFleet
from specsplit.bench.load import log


# ---- the two doors ----------------------------------------------------------------------------
def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")  # where the API was configured with keys
    return {"Authorization": f"Bearer {key}"} if key else {}


async def wait_api(fleet: HonchoFleet, timeout_s: float) -> str:
    """The served model's name, once GET /health answers 200 (the fleet served a generation)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0, headers=_headers()) as http:
        while True:
            fleet.check()
            try:
                if (await http.get(f"{fleet.api_url}/health")).status_code == 200:
                    return (await http.get(f"{fleet.api_url}/v1/models")).json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fleet.api_url}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(1.0)


class Doors:
    """One fleet's two doors, each answering prompt i: the HTTP API through ``openai``'s
    AsyncOpenAI (streaming) and the fleet's producer client (OrchestratorPool)."""

    def __init__(self, args, fleet: HonchoFleet, model: str, codec, texts: list[str], prompts: list[list[int]],
                 endpoint: str) -> None:
        import httpx
        from openai import AsyncOpenAI

        from specsplit.config import ProducerSettings
        from specsplit.pool import OrchestratorPool

        self.args, self.fleet, self.model, self.codec, self.endpoint = args, fleet, model, codec, endpoint
        self.texts, self.prompts, self.restarts = texts, prompts, 0
        n = max(args.levels) + 8
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                                 timeout=httpx.Timeout(args.request_timeout_s, connect=10.0))
        self.client = AsyncOpenAI(base_url=f"{fleet.api_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                                  max_retries=0, timeout=args.request_timeout_s, http_client=http)
        ps = ProducerSettings()  # produce's settings, the fleet's address
        self.pool = OrchestratorPool([fleet.orchestrator], timeout_s=args.request_timeout_s,
                                     chunk_timeout_s=ps.produce_chunk_timeout_s, heartbeat_s=ps.produce_heartbeat_s,
                                     liveness=ps.produce_liveness, max_resumes=ps.produce_max_resumes)

    async def __aenter__(self) -> Doors:
        await self.pool.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.client.close()
        finally:
            await self.pool.__aexit__(*exc)

    async def api(self, i: int, max_new_tokens: int) -> Answer:
        kw = {"model": self.model, "max_tokens": max_new_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
        parts, times, usage, finish, t0 = [], [], None, None, time.perf_counter()
        async with asyncio.timeout(self.args.request_timeout_s):
            if self.endpoint == "chat":
                stream = await self.client.chat.completions.create(
                    messages=[{"role": "user", "content": self.texts[i]}], **kw)
            else:
                stream = await self.client.completions.create(prompt=self.prompts[i], **kw)
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter() - t0
                    usage = chunk.usage or usage
                    for c in chunk.choices:
                        piece = (c.delta.content if self.endpoint == "chat" else c.text) or ""
                        if piece:
                            parts.append(piece)
                            times.append(now)
                        if c.finish_reason:
                            finish = (c.finish_reason, now)
        if finish is None or usage is None:
            raise RuntimeError(f"the stream ended without {'a finish_reason' if finish is None else 'its usage'}")
        return Answer(i, "".join(parts), usage.completion_tokens, times[0] if times else None, finish[1], len(parts),
                      finish[0], usage.prompt_tokens)

    async def producer(self, i: int, max_new_tokens: int) -> Answer:
        """Tokens in, whole characters out, as ``specsplit produce`` streams them (and the API:
        the same IncrementalDecoder), so the first text is timed alike at both doors."""
        from schemas import SamplingSpec
        from specsplit.api.textstream import IncrementalDecoder

        text, t0, times, first_token = IncrementalDecoder(self.codec.decode, self.prompts[i]), time.perf_counter(), [], []

        def seen(tokens: list[int]) -> None:
            now = time.perf_counter() - t0
            first_token.extend([now] if tokens and not first_token else [])
            if text.push(tokens):
                times.append(now)

        async with asyncio.timeout(self.args.request_timeout_s):
            res = await self.pool.generate(self.prompts[i], max_new_tokens=max_new_tokens, sampling=SamplingSpec(),
                                           stop_token_ids=self.codec.stop_token_ids, on_tokens=seen)
        end, tail = time.perf_counter() - t0, text.finish()  # (the API sends a held tail with its last chunk)
        return Answer(i, self.codec.decode(res.token_ids), len(res.token_ids), times[0] if times else (end if tail else None),
                      end, len(times) + bool(tail), res.finish_reason, len(self.prompts[i]),
                      first_token_s=first_token[0] if first_token else None)

    async def wait_producer(self, timeout_s: float) -> None:
        from specsplit.produce import wait_until_serving

        if not await wait_until_serving(self.pool, self.prompts[0][:8], timeout_s):
            raise TimeoutError(f"the orchestrator at {self.fleet.orchestrator} did not serve within {timeout_s:.0f} s")

    async def fresh(self, timeout_s: float) -> None:
        """A new orchestrator (nothing learned from earlier passes), once both doors got a
        one-token answer through it."""
        import openai

        await self.fleet.restart(timeout_s)
        self.restarts += 1
        await self.wait_producer(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await self.client.completions.create(model=self.model, prompt=self.prompts[0][:8], max_tokens=1,
                                                         temperature=0)
                return
            except (openai.APIError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the API did not serve within {timeout_s:.0f} s of the restart: {exc!r}") from exc
            await asyncio.sleep(0.5)


async def run_pass(one, n: int, concurrency: int, max_new_tokens: int) -> Pass:
    """Prompts 0..n-1 through ``one``, ``concurrency`` in flight at once; a failure is recorded."""
    slots = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> Answer:
        async with slots:
            try:
                return await one(i, max_new_tokens)
            except Exception as exc:  # noqa: BLE001 -- every failure is counted, named in the JSON
                return Answer(i, error=f"{type(exc).__name__}: {exc}"[:300])

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(guarded(i) for i in range(n)))
    return Pass(list(answers), time.perf_counter() - t0)


async def run_levels(args, doors: Doors) -> list[dict]:
    rows = []
    for k, c in enumerate(args.levels):
        order = ("api", "producer") if k % 2 == 0 else ("producer", "api")  # alternate to cancel drift
        order = (*order, order[0]) if args.aba else order
        passes: dict[str, list[Pass]] = {"api": [], "producer": []}
        for name in order:
            await doors.fresh(args.restart_timeout_s)
            log(f"concurrency {c}: {name} ...")
            p = await run_pass(getattr(doors, name), len(doors.prompts), c, args.max_new_tokens)
            passes[name].append(p)
            log(f"concurrency {c}: {name} {sum(a.tokens for a in p.answers) / p.wall_s:.2f} tok/s in {p.wall_s:.1f} s"
                + (f", {sum(bool(a.error) for a in p.answers)} failed" if any(a.error for a in p.answers) else ""))
        rows.append(make_row(c, list(order), passes["api"], passes["producer"]))
    return rows


# ---- the run ----------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench api", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16", help="comma list of requests in flight at once")
    p.add_argument("--prompts", type=int, default=None,
                   help="HumanEval prompts, the same at every level (default: max(16, largest concurrency))")
    p.add_argument("--offset", type=int, default=0, help="skip this many HumanEval prompts first")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="the chat template, as specsplit produce applies it")
    p.add_argument("--endpoint", choices=["chat", "completions"], default=None,
                   help="the API's door: chat (the prompt as the user message) or completions (the token ids "
                        "produce sends); default: chat where the template is applied")
    p.add_argument("--env-file", default=None,
                   help="the fleet's default settings (default: ./.env, which every specsplit command applies, "
                        "else the repository's; 'none': only what the command applied, and "
                        "SPECSPLIT_ENV_FILE= keeps it from applying ./.env)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.add_argument("--keep-logs", action="store_true", help="keep the fleet's logs (kept anyway when the run fails)")
    p.add_argument("--aba", action=argparse.BooleanOptionalAction, default=True,
                   help="run each level's first door again after the second (A B A) to cancel the machine's drift")
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="for the fleet to serve (models load)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="for one request")
    p.add_argument("--restart-timeout-s", type=float, default=120.0, help="for a fresh orchestrator to serve")
    args = p.parse_args(argv)
    try:
        args.levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency: a comma list of integers, got {args.concurrency!r}")
    if not args.levels or args.levels[0] < 1 or args.max_new_tokens < 1:
        p.error("--concurrency takes integers >= 1 and --max-new-tokens >= 1")
    args.prompts = args.prompts or max(16, args.levels[-1])
    return args


def machine_info() -> dict:
    """Where the figures come from: the CPU, the Python, the commit, the date."""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        cpu = ""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, "machine": platform.processor() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version(), "commit": commit,
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


async def bench(args, fleet: HonchoFleet, model_settings) -> tuple[list[dict], dict]:
    """Wait for the fleet, then every level through both doors; (rows, what the JSON records)."""
    from specsplit.api.tokenizer import wait_for_tokenizer_dir
    from specsplit.bench.systems import humaneval_prompts
    from specsplit.produce import PromptCodec

    model = await wait_api(fleet, args.ready_timeout_s)  # the API serves: the tokenizer files are there
    codec = PromptCodec(wait_for_tokenizer_dir(model_settings, 60.0), chat=args.chat)
    endpoint = args.endpoint or ("chat" if codec.use_chat else "completions")
    if endpoint == "chat" and not codec.use_chat:
        raise SystemExit("specsplit bench api: --endpoint chat sends what produce sends only with the chat template")
    pool = humaneval_prompts()[args.offset:]
    if not pool:
        raise SystemExit(f"specsplit bench api: --offset {args.offset} leaves no HumanEval prompt")
    texts = [pool[i % len(pool)] for i in range(args.prompts)]
    prompts = [codec.encode(t) for t in texts]
    async with Doors(args, fleet, model, codec, texts, prompts, endpoint) as doors:
        await doors.wait_producer(args.ready_timeout_s)
        await doors.api(0, 8)  # warm-up: first-call costs (connections, caches) out of the timing
        await doors.producer(0, 8)
        rows = await run_levels(args, doors)
        restarts = doors.restarts
    return rows, {"model": model, "endpoint": endpoint, "use_chat": codec.use_chat, "stop_token_ids": codec.stop_token_ids,
                  "prompt_tokens": [len(p) for p in prompts], "distinct_prompts": len(set(texts)),
                  "orchestrator_restarts": restarts}


def _require_clients() -> None:
    missing = [m for m in ("openai", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"specsplit bench api needs {' and '.join(missing)}: pip install -e '.[test,bench]'")


def main(argv=None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the fleet
    args = parse(argv)
    _require_clients()
    from specsplit.api.tokenizer import keep_torch_out

    keep_torch_out()  # this process holds tokenizers and clients only, as a producer does
    from specsplit.bench.fleetenv import environ_with, fleet_defaults
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings

    configure_logging("ERROR")  # (the pool warns of each orchestrator restart: ours)
    defaults = fleet_defaults(args.env_file)
    with environ_with(defaults):
        ms = ModelSettings(**({"preset": args.preset} if args.preset else {}))
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-api-"))
    load_before = os.getloadavg()
    # the supervisor's back-off after each orchestrator restart of ours: at most 1 s
    fleet = HonchoFleet(tmp, ms.preset, defaults, SPECSPLIT_SUPERVISE_BACKOFF_MAX_S="1").start()
    log(f"fleet starting: honcho start (logs in {tmp})")
    out, honcho_rc = None, None
    try:
        out = asyncio.run(bench(args, fleet, ms))
    finally:
        honcho_rc = fleet.stop()
        if out is None or args.keep_logs:
            log(f"fleet logs kept in {tmp}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    rows, info = out
    summary = summarize(rows)
    print(markdown(rows))
    print(f"identical API vs producer: {summary['identical']}; failed requests: {summary['failed']}")
    config = {k: v for k, v in vars(args).items()} | info | {
        "preset": ms.preset, "fleet_settings": fleet.settings, "env_file_defaults": defaults, "honcho_exit_code": honcho_rc,
        **machine_info(), "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"config": config, "rows": rows, "summary": summary}, indent=2))
        plot_path = args.plot or str(Path(args.json_path).with_suffix(".png"))
        plot(plot_path, rows, f"{ms.preset}: {args.prompts} HumanEval prompts x {args.max_new_tokens} new tokens, "
                              f"API ({info['endpoint']}) vs producer")
        log(f"wrote {args.json_path} and {plot_path}")
    return 0 if summary["all_identical"] and not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
