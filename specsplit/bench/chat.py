"""``specsplit bench chat``: conversations of several turns through the HTTP API, on a fleet whose
workers keep a prefix cache and on one whose workers do not, side by side in one run.

A conversation's turn N sends every earlier turn again (the OpenAI API is stateless): without a
prefix cache the workers forward the whole history at every turn, with it only what they have not
seen. Two fleets are started as people start one (``honcho start``, the repository's Procfile and
.env, on free ports), one with ``SPECSPLIT_TARGET_PREFIX_CACHE_GB=0`` and
``SPECSPLIT_DRAFT_PREFIX_CACHE_GB=0`` ("off"), one with the settings as they are ("on"); they
load side by side and then take turns: each turn of each conversation goes to both, one request
in flight at a time, the first one alternating from turn to turn and, at each turn, from
conversation to conversation, so a drift of the machine, or going first, weighs on both alike.

Each conversation starts from a chat10 prompt (or ``--prompts FILE``) and goes on with fixed
follow-up questions; each fleet's answers go into its own history. Greedy: the two fleets'
answers must be equal (the cache changes how much is forwarded, not what is answered); the exit
code is 1 when one is not, or a request failed. Per turn: the prompt's tokens (usage), time to
first token at both fleets (the first streamed text), their ratio, and the tokens each target
copied from its prefix cache (its ``specsplit:worker_prefix_cache_hits`` counter).

    specsplit bench chat --json runs/chat.json
    specsplit bench chat --preset tiny --conversations 2 --turns 3 --max-new-tokens 8 --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from specsplit.bench.api import _headers, _require_clients, machine_info, wait_api
from specsplit.bench.honcho import HonchoFleet
from specsplit.bench.load import log, percentile

FOLLOW_UPS = (
    "Can you explain that in more detail, with an example?",
    "What do people most often get wrong about this?",
    "Summarize everything so far in three bullet points.",
    "Now say it in one sentence.",
    "Thank you. Is there anything important you left out?",
)
OFF = {"SPECSPLIT_TARGET_PREFIX_CACHE_GB": "0", "SPECSPLIT_DRAFT_PREFIX_CACHE_GB": "0"}
HITS = "specsplit:worker_prefix_cache_hits_total"


def metrics_base(taken: list[int]) -> int:
    """A base metrics port whose roles' ports (brokers.metrics' offsets) are free and apart from
    the ranges of the bases ``taken`` and from every port drawn before; its range is reserved."""
    from brokers.metrics import ROLE_OFFSETS, ROLE_SLOTS
    from specsplit.launch import free_ports, handed_out, port_is_free, reserve

    span = max(ROLE_OFFSETS.values()) + ROLE_SLOTS
    for _ in range(200):
        base = free_ports(1)[0] - ROLE_OFFSETS["target"]
        if base > 1024 and base + span < 65536 and all(abs(base - t) >= span for t in taken) \
                and all(port_is_free(base + off) for off in ROLE_OFFSETS.values()) \
                and not any(handed_out(p) for p in range(base, base + span) if p != base + ROLE_OFFSETS["target"]):
            reserve(range(base, base + span))  # (no fleet's address drawn after it falls in its roles' ports)
            return base
    raise RuntimeError("no free range of metrics ports")


class Fleet:
    """One fleet, its API client and its conversations' histories."""

    def __init__(self, name: str, fleet: HonchoFleet, args) -> None:
        self.name, self.fleet, self.args = name, fleet, args
        self.histories: dict[int, list[dict]] = {}
        self.client = self.model = None

    async def connect(self) -> None:
        import httpx
        from openai import AsyncOpenAI

        self.model = await wait_api(self.fleet, self.args.ready_timeout_s)
        http = httpx.AsyncClient(timeout=httpx.Timeout(self.args.request_timeout_s, connect=10.0))
        self.client = AsyncOpenAI(base_url=f"{self.fleet.api_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                                  max_retries=0, timeout=self.args.request_timeout_s, http_client=http)

    def prefix_hits(self) -> float | None:
        """Tokens the target worker copied from its prefix cache so far (its metrics), or None."""
        import httpx

        from brokers.metrics import ROLE_OFFSETS

        base = int(self.fleet.settings["SPECSPLIT_METRICS_PORT"])
        try:
            text = httpx.get(f"http://127.0.0.1:{base + ROLE_OFFSETS['target']}/metrics", timeout=5.0,
                             headers=_headers()).text
        except httpx.HTTPError:
            return None
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(HITS))

    async def turn(self, conv: int, message: str) -> dict:
        """Send the conversation so far plus ``message``; the answer joins the history."""
        history = self.histories.setdefault(conv, [])
        messages = [*history, {"role": "user", "content": message}]
        hits_before = self.prefix_hits()
        parts, first, usage, finish, t0 = [], None, None, None, time.perf_counter()
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                stream = await self.client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.args.max_new_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True})
                async with stream:
                    async for chunk in stream:
                        usage = chunk.usage or usage
                        for c in chunk.choices:
                            if c.delta.content:
                                first = first if first is not None else time.perf_counter() - t0
                                parts.append(c.delta.content)
                            finish = c.finish_reason or finish
        except Exception as exc:  # recorded; the run fails at the end
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        end = time.perf_counter() - t0
        text = "".join(parts)
        self.histories[conv] = [*messages, {"role": "assistant", "content": text}]
        hits_after = self.prefix_hits()
        return {"text": text, "ttft_s": first, "end_s": end, "finish_reason": finish,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
                "prefix_hit_tokens": None if hits_before is None or hits_after is None else hits_after - hits_before}


async def run(args, fleets: dict[str, Fleet], prompts: list[str]) -> list[dict]:
    await asyncio.gather(*(f.connect() for f in fleets.values()))
    for f in fleets.values():  # warm-up: first-call costs out of the timing (and a context no turn shares)
        await f.turn(-1, "Say hello.")
    records = []
    for conv in range(args.conversations):
        for turn in range(args.turns):
            message = prompts[conv % len(prompts)] if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
            # the first fleet alternates turn by turn and, at each turn, conversation by conversation
            order = ["off", "on"] if (conv + turn) % 2 == 0 else ["on", "off"]
            got = {name: await fleets[name].turn(conv, message) for name in order}
            same = all("error" not in got[n] for n in order) and got["off"]["text"] == got["on"]["text"]
            records.append({"conversation": conv, "turn": turn, "order": order, "identical": same, **got})
            log(f"conversation {conv} turn {turn}: prompt {got['on'].get('prompt_tokens')} tokens, TTFT off "
                f"{_fmt(got['off'].get('ttft_s'))} on {_fmt(got['on'].get('ttft_s'))}, identical {same}")
    return records


def _fmt(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f} ms"


def rows_of(records: list[dict]) -> list[dict]:
    """Per turn index: prompt tokens, TTFT p50 at both fleets and off / on, tokens reused, identical."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        ok = [r for r in rs if "error" not in r["off"] and "error" not in r["on"]
              and r["off"]["ttft_s"] is not None and r["on"]["ttft_s"] is not None]
        off = [r["off"]["ttft_s"] for r in ok]
        on = [r["on"]["ttft_s"] for r in ok]
        p50_off, p50_on = (percentile(off, 50), percentile(on, 50)) if ok else (None, None)
        rows.append({
            "turn": turn + 1, "conversations": len(rs),
            "prompt_tokens_mean": round(sum(r["on"]["prompt_tokens"] for r in ok) / len(ok), 1) if ok else None,
            "ttft_off_p50_ms": None if p50_off is None else round(p50_off * 1e3, 1),
            "ttft_on_p50_ms": None if p50_on is None else round(p50_on * 1e3, 1),
            "ttft_ratio_p50": round(p50_off / p50_on, 3) if ok and p50_on else None,
            "ttft_ratios": [round(a / b, 3) for a, b in zip(off, on)],
            "reused_tokens_mean": _mean([r["on"].get("prefix_hit_tokens") for r in ok]),
            "reused_tokens_off_mean": _mean([r["off"].get("prefix_hit_tokens") for r in ok]),
            "identical": sum(r["identical"] for r in rs),
        })
    return rows


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 1) if xs else None


def markdown(rows: list[dict]) -> str:
    out = ["| turn | prompt tokens | TTFT p50 ms, cache off | TTFT p50 ms, cache on | off / on | tokens reused | identical |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ttft_ratio_p50"] is None else f"{r['ttft_ratio_p50']:.2f}x"
        out.append(f"| {r['turn']} | {r['prompt_tokens_mean']} | {r['ttft_off_p50_ms']} | {r['ttft_on_p50_ms']} | "
                   f"{ratio} | {r['reused_tokens_mean']} | {r['identical']}/{r['conversations']} |")
    return "\n".join(out)


def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="chat10", help="first turns: a named set or a JSONL file ('prompt' per line)")
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--env-file", default=None,
                   help="the fleets' default settings (default: ./.env, which every specsplit command applies, "
                        "else the repository's; 'none': only what the command applied)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--keep-logs", action="store_true", help="keep the fleets' logs (kept anyway when the run fails)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="for the fleets to serve (models load)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="for one request")
    args = p.parse_args(argv)
    if args.conversations < 1 or args.turns < 1 or args.max_new_tokens < 1:
        p.error("--conversations, --turns and --max-new-tokens must be at least 1")
    return args


def main(argv=None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the fleets
    args = parse(argv)
    _require_clients()
    from specsplit.api.tokenizer import keep_torch_out

    keep_torch_out()  # this process holds clients only
    from specsplit.bench.fleetenv import environ_with, fleet_defaults
    from specsplit.bench.systems import jsonl_prompts
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings

    configure_logging("ERROR")
    prompts = jsonl_prompts(args.prompts)
    defaults = fleet_defaults(args.env_file)
    with environ_with(defaults):
        ms = ModelSettings(**({"preset": args.preset} if args.preset else {}))
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-chat-"))
    load_before, machine = os.getloadavg(), machine_info()  # the commit the fleets start from
    fleets: dict[str, Fleet] = {}
    bases: list[int] = []
    for name, extra in (("off", OFF), ("on", {})):
        (tmp / name).mkdir()
        bases.append(metrics_base(bases))
        fleet = HonchoFleet(tmp / name, ms.preset, defaults, SPECSPLIT_METRICS_PORT=str(bases[-1]), **extra)
        fleets[name] = Fleet(name, fleet.start(), args)
    log(f"two fleets starting: honcho start (logs in {tmp})")
    records, codes = None, {}
    try:
        records = asyncio.run(run(args, fleets, prompts))
    finally:
        for name, f in fleets.items():
            codes[name] = f.fleet.stop()
        if records is None or args.keep_logs:
            log(f"fleet logs kept in {tmp}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = rows_of(records)
    failed = sum("error" in r[n] for r in records for n in ("off", "on"))
    identical = sum(r["identical"] for r in records)
    print(markdown(rows))
    print(f"identical cache on vs off: {identical}/{len(records)}; failed requests: {failed}")
    config = {k: v for k, v in vars(args).items()} | {
        "preset": ms.preset, "model": fleets["on"].model, "follow_ups": FOLLOW_UPS,
        "fleet_settings": {n: f.fleet.settings for n, f in fleets.items()}, "honcho_exit_codes": codes,
        **machine, "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"config": config, "rows": rows, "records": records,
                                                    "summary": {"identical": f"{identical}/{len(records)}",
                                                                "failed": failed}}, indent=2))
        log(f"wrote {args.json_path}")
    return 0 if identical == len(records) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
