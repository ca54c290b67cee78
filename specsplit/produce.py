"""``specsplit produce``: push prompts to the orchestrator, stream text back, print figures.

Prompts come from arguments, ``--file`` (one per line), ``--jsonl FILE`` (a ``prompt`` field per
line, as HumanEval's), or stdin. Instruct models get their chat template (``--chat auto``, the
default, applies it when the tokenizer has one); stopping follows the tokenizer's and the
generation config's end tokens.

Orchestrators: ``--orchestrator`` (a comma list) or SPECSPLIT_ORCHESTRATOR and
SPECSPLIT_ORCHESTRATOR_COUNT (that address and the next count-1 ports, as ``honcho start -c
orchestrator=N`` binds them). Requests are spread over the live ones; a request whose orchestrator
dies, hangs or stops is resumed from the tokens already received (``specsplit.pool``), so greedy
answers equal an uninterrupted run. Only finished answers ("stop" / "length") are printed; a
prompt that could not be finished is reported on stderr and makes the exit code 1.
``--json-schema FILE`` holds every answer to a JSON Schema (the target's constrained decoding);
``--logprobs N`` adds each answer token's log-probability and N alternatives to ``--json`` rows,
``--prompt-logprobs N`` those of the prompt's tokens after its first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from schemas import GrammarSpec, SamplingSpec
from schemas.messages import MAX_TOP_LOGPROBS
from specsplit.api.textstream import IncrementalDecoder


def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line.rstrip("\n") for line in Path(args.file).read_text().splitlines() if line.strip()]
    if args.jsonl:
        for line in Path(args.jsonl).read_text().splitlines():
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
    if not prompts and not sys.stdin.isatty():
        prompts += [line for line in sys.stdin.read().splitlines() if line.strip()]
    if args.limit:
        prompts = prompts[: args.limit]
    return prompts


class PromptCodec:
    """Tokenizer side of the producer: prompt text -> ids (chat template when wanted), ids -> text.
    The served model's tokenizer alone (``specsplit.api.tokenizer.ServedTokenizer``), as the HTTP
    API holds it: the same ids for the same prompt on both doors."""

    def __init__(self, tokenizer_dir: Path, chat: str = "auto"):
        from specsplit.api.tokenizer import ServedTokenizer

        self.served = ServedTokenizer(tokenizer_dir)
        self.tok = self.served.tok
        self.use_chat = chat == "on" or (chat == "auto" and self.served.has_chat_template)
        self.stop_token_ids = self.served.stop_token_ids

    def encode(self, prompt: str) -> list[int]:
        if self.use_chat:
            return self.served.encode_chat([{"role": "user", "content": prompt}])
        return self.served.encode(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.served.decode(ids)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit produce", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompt texts (or --file / --jsonl / stdin)")
    p.add_argument("--file", help="a file of prompts, one a line")
    p.add_argument("--jsonl", help="a JSON-lines file with a 'prompt' field per line (HumanEval's format)")
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts (0: all)")
    p.add_argument("--concurrency", type=int, default=1, help="prompts in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (equal to the target's greedy decoding)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling, 0 to 1 (0: off)")
    p.add_argument("--min-tokens", type=int, default=0, help="no end token among the first this many (vLLM's)")
    p.add_argument("--ignore-eos", action="store_true", help="the end tokens do not end an answer (vLLM's)")
    for name, help_ in (("presence", "-2 to 2, 0: off"), ("frequency", "-2 to 2, 0: off"),
                        ("repetition", "above 0, 1: off")):
        p.add_argument(f"--{name}-penalty", type=float, default=None, help=f"vLLM's {name} penalty ({help_})")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed of prompt i is SEED + i (as the HTTP API seeds n choices); "
                        "unset: a fresh random seed per prompt")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="apply the model's chat template (auto: when the tokenizer has one)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="hold every answer to this JSON Schema (docs/operations.md, JSON output)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N most likely alternatives (0-20)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="with --json: the prompt's tokens' too (after its first), with N alternatives (0-20)")
    p.add_argument("--orchestrator", default=None,
                   help="comma list of addresses; default: SPECSPLIT_ORCHESTRATOR (+ SPECSPLIT_ORCHESTRATOR_COUNT ports)")
    p.add_argument("--wait-s", type=float, default=600.0, help="wait this long for the fleet to answer a ping")
    return p


async def produce(args, codec: PromptCodec, addrs: list[str] | str, timeout_s: float, chunk_timeout_s: float = 300.0,
                  *, heartbeat_s: float = 1.0, liveness: int = 3, max_resumes: int = 16, curve=None,
                  per_prompt_token_s: float = 0.0) -> int:
    from specsplit.client import GenerationError, OrchestratorRefused
    from specsplit.pool import FINISHED, OrchestratorPool

    addrs = [addrs] if isinstance(addrs, str) else list(addrs)
    prompts = read_prompts(args)
    if not prompts:
        print("specsplit produce: no prompts", file=sys.stderr)
        return 2
    try:
        grammar = read_schema(args.json_schema) if args.json_schema else None
    except ValueError as exc:
        print(f"specsplit produce: --json-schema: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.min_tokens <= args.max_new_tokens or (args.min_tokens and args.json_schema):
        print("specsplit produce: --min-tokens must be 0 to --max-new-tokens, and 0 with --json-schema", file=sys.stderr)
        return 2
    for flag in ("logprobs", "prompt_logprobs"):
        if getattr(args, flag) is not None and not 0 <= getattr(args, flag) <= MAX_TOP_LOGPROBS:
            print(f"specsplit produce: --{flag.replace('_', '-')} must be 0 to {MAX_TOP_LOGPROBS}", file=sys.stderr)
            return 2
    def sampling(i: int) -> SamplingSpec:
        seed = secrets.randbits(63) if args.seed is None else (args.seed + i) % 2**63
        return SamplingSpec(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=seed,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty)

    try:
        sampling(0)
    except ValidationError as exc:  # e.g. a penalty out of its range
        err = exc.errors()[0]
        print(f"specsplit produce: --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", file=sys.stderr)
        return 2

    stream = args.concurrency == 1 and not args.json
    sem = asyncio.Semaphore(max(1, args.concurrency))
    failures = 0
    async with OrchestratorPool(addrs, timeout_s=timeout_s, chunk_timeout_s=chunk_timeout_s, heartbeat_s=heartbeat_s,
                                liveness=liveness, max_resumes=max_resumes, curve=curve,
                                per_prompt_token_s=per_prompt_token_s) as pool:
        try:
            serving = await wait_until_serving(pool, codec.encode(prompts[0])[:8], args.wait_s)
        except OrchestratorRefused as exc:
            print(f"specsplit produce: refused: {exc}", file=sys.stderr)
            return 2
        if not serving:
            print(f"specsplit produce: no orchestrator of {addrs} served within {args.wait_s:.0f}s", file=sys.stderr)
            return 3
        t0 = time.perf_counter()

        async def one(i: int, prompt: str):
            nonlocal failures
            ids = codec.encode(prompt)
            async with sem:
                on_tokens, text = None, IncrementalDecoder(codec.decode, ids)
                if stream:  # whole characters only, however the bytes fall across rounds
                    print(f"\n=== prompt {i}: {prompt[:80]!r}", file=sys.stderr, flush=True)
                    on_tokens = lambda toks: print(text.push(toks), end="", flush=True)  # noqa: E731
                try:
                    res = await pool.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling(i),
                                              stop_token_ids=[] if args.ignore_eos else codec.stop_token_ids,
                                              on_tokens=on_tokens, grammar=grammar, logprobs=args.logprobs,
                                              prompt_logprobs=args.prompt_logprobs, min_tokens=args.min_tokens)
                    if stream:
                        print(text.finish(), end="", flush=True)
                except (GenerationError, TimeoutError, asyncio.TimeoutError) as exc:
                    failures += 1
                    print(f"prompt {i} failed: {exc!r}", file=sys.stderr)
                    return None
            if res.finish_reason not in FINISHED:  # never print an unfinished answer as one
                failures += 1
                print(f"prompt {i} failed: finish_reason={res.finish_reason}", file=sys.stderr)
                return None
            report(i, prompt, res, codec, args, stream)
            return res

        results = [r for r in await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))) if r]
        wall = time.perf_counter() - t0
    summary(results, wall)
    return 1 if failures else 0


def read_schema(path: str) -> GrammarSpec:
    """A JSON Schema file as the grammar of the answers (ValueError: not JSON)."""
    text = Path(path).read_text()
    try:
        json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    return GrammarSpec(kind="json_schema", text=text)


async def wait_until_serving(pool, probe_ids: list[int], wait_s: float) -> bool:
    """Readiness by handshake: an orchestrator answers a ping, then a one-token generation
    succeeds end to end (workers may still be loading their models when the fleet starts)."""
    from specsplit.client import GenerationError, OrchestratorRefused

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if pool.clients and all(c.refused for c in pool.clients):  # every orchestrator refused our CURVE key
            raise OrchestratorRefused("; ".join(c.refused for c in pool.clients))
        if await pool.ping(timeout_s=2.0):
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await pool.generate(probe_ids, max_new_tokens=1)
                return True
            except GenerationError as exc:
                if not exc.reply.retryable and exc.reply.code.value not in ("NO_WORKER", "INTERNAL"):
                    raise
            except (TimeoutError, asyncio.TimeoutError):
                pass
        await asyncio.sleep(1.0)
    return False


def report(i, prompt, res, codec, args, streamed: bool) -> None:
    text = codec.decode(res.token_ids)
    if args.json:
        print(json.dumps({
            "index": i, "prompt": prompt, "prompt_token_ids": res.prompt_token_ids, "token_ids": res.token_ids, "text": text,
            "finish_reason": res.finish_reason, "new_tokens": len(res.token_ids), "tok_per_s": res.tokens_per_s,
            "rounds": res.rounds, "resumes": res.resumes, "mean_accepted": res.mean_accepted, "acceptance_rate": res.acceptance_rate,
            "elapsed_s": res.elapsed_s, **request_figures(res),
            **({"logprobs": res.logprobs.model_dump()} if res.logprobs is not None else {}),
            **({"prompt_logprobs": res.prompt_logprobs.model_dump()} if res.prompt_logprobs is not None else {}),
        }), flush=True)
    elif not streamed:
        print(f"\n=== prompt {i}: {prompt[:80]!r}\n{text}", flush=True)
    else:
        print(flush=True)  # end the streamed answer's line
    print(f"[{i}] {len(res.token_ids)} new tokens in {res.elapsed_s:.2f}s = {res.tokens_per_s:.2f} tok/s, "
          f"{res.rounds} rounds, mean accepted {res.mean_accepted:.2f}/round, acceptance {res.acceptance_rate:.1%}, "
          f"finish={res.finish_reason}", file=sys.stderr, flush=True)


def request_figures(res) -> dict:
    """Per-request speculation figures (docs/operations.md, "Metrics": the counting rules): drafted tokens
    (tree nodes proposed, roots excluded), accepted tokens (bonus excluded) and by position,
    mean accepted length (tokens committed per round: (accepted + rounds) / rounds), time to
    first token as this producer saw it and as the orchestrator measured it (from arrival), and
    the prompt's tokens the target copied from its prefix cache."""
    return {
        "drafted_tokens": res.drafted_tokens, "accepted_tokens": res.accepted_tokens,
        "accepted_per_pos": res.accepted_per_pos, "mean_accepted_length": res.mean_accepted,
        "time_to_first_token_s": res.first_token_s, "orchestrator_first_token_ms": res.orchestrator_first_token_ms,
        "cached_tokens": res.cached_tokens,
    }


def summary(results, wall: float) -> None:
    toks = sum(len(r.token_ids) for r in results)
    rounds = sum(r.rounds for r in results)
    acc = sum(r.accepted_tokens for r in results)
    drafted = sum(r.drafted_tokens for r in results)
    print(f"TOTAL {len(results)} prompts, {toks} new tokens in {wall:.2f}s = {toks / wall if wall else 0:.2f} tok/s, "
          f"mean accepted {(acc + rounds) / rounds if rounds else 0:.2f}/round, "
          f"acceptance {acc / drafted if drafted else 0:.1%}", file=sys.stderr, flush=True)


def produce_main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specsplit.api.tokenizer import keep_torch_out, wait_for_tokenizer_dir

    keep_torch_out()  # a producer holds a tokenizer only
    from specsplit.config import ProducerSettings
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings

    settings = ProducerSettings()
    configure_logging(settings.log_level if settings.log_level != "INFO" else "WARNING", settings.log_json)
    from brokers.curve import CurveError

    try:
        curve = settings.curve_keys(client=True)
    except CurveError as exc:
        print(f"specsplit produce: {exc}", file=sys.stderr)
        return 2
    try:  # the workers (or `specsplit models pull`) provision the models; this waits for the files
        path = wait_for_tokenizer_dir(ModelSettings(), args.wait_s)
    except TimeoutError as exc:
        print(f"specsplit produce: {exc}", file=sys.stderr)
        return 3
    codec = PromptCodec(path, chat=args.chat)
    addrs = args.orchestrator.split(",") if args.orchestrator else settings.orchestrator_addresses()
    return asyncio.run(produce(args, codec, [a.strip() for a in addrs if a.strip()], settings.produce_timeout_s,
                               settings.produce_chunk_timeout_s, heartbeat_s=settings.produce_heartbeat_s,
                               liveness=settings.produce_liveness, max_resumes=settings.produce_max_resumes,
                               curve=curve, per_prompt_token_s=settings.produce_timeout_per_prompt_token_s))
