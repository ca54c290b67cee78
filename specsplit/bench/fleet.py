"""Fleet tok/s vs the in-process reference loop (``specsplit.local.generate``) on the tiny models.

One fleet (router pair, 1 draft + 1 target worker at one torch thread each) with two
orchestrators on the same routers: one with no overlap at all (``SPECSPLIT_GROW=false``) and one
with tree growth (the default: the draft grows the whole tree while the target verifies it and
re-roots it at the bonus token). The reference loop runs in this process with the same tiny pair in
fp32 at one torch thread. One session at a time, the same random token-id prompts (fixed seed),
the same TreeSpec and greedy sampling, the order of the three systems rotating per prompt.
Goal: fleet >= 0.9x the reference loop without growth, above it with growth.
The reference loop drafts and verifies in turn in one process (growth cannot help it).

A fifth system, ``local_2proc``, is the same reference loop with the target engine moved into a
second process behind a plain ``multiprocessing`` pipe (no ZeroMQ, no router, no codec): the floor
of any split into processes on this machine. Whatever separates it from ``local`` is the cost of
running the engines in two processes at all (wake-ups, cold caches), not of the transport.

    specsplit bench transport --json runs/bench_transport.json   (``--no-fleet`` skips this part)
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from schemas import SamplingSpec, TreeSpec

SYSTEMS = ("local", "local_2proc", "fleet", "fleet_grow")


def _pipe_target_main(conn, threads: int) -> None:
    """The target engine of ``local_2proc``: (key, limits, request) in, reply out, until None."""
    import torch

    from specsplit.engine.target import TargetEngine
    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    torch.set_num_threads(threads)
    target, _ = load_model(resolve_model_paths(ModelSettings(preset="tiny"), progress=False).target,
                           dtype="float32", threads=threads)
    engines: dict[int, TargetEngine] = {}
    conn.send("ready")
    while (item := conn.recv()) is not None:
        key, limits, msg = item
        if key not in engines:
            engines.clear()  # one generate() at a time: the previous one's engine is done
            engines[key] = TargetEngine(target, limits)
        conn.send(engines[key].handle(msg))


class PipeTarget:
    """A TargetEngine stand-in for ``specsplit.local.generate`` that forwards every request to a
    target engine in another process over a multiprocessing pipe (pickled messages)."""

    def __init__(self, threads: int = 1, timeout_s: float = 240.0) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pipe_target_main, args=(child, threads), daemon=True)
        self.proc.start()
        if not self._conn.poll(timeout_s) or self._conn.recv() != "ready":
            self.close()
            raise RuntimeError("pipe target did not start")
        self._keys = 0
        self.timeout_s = timeout_s

    def engine(self, _model, limits):
        """Called as ``TargetEngine(model, limits)`` by ``generate``: one engine per call."""
        self._keys += 1
        key, conn, timeout_s = self._keys, self._conn, self.timeout_s

        class _Remote:
            def handle(self, msg):
                conn.send((key, limits, msg))
                if not conn.poll(timeout_s):
                    raise TimeoutError("pipe target did not answer")
                return conn.recv()

        return _Remote()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 8, max_len: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Systems:
    """The five systems behind one call: the in-process loop here (alone, and with its target in a
    second process), and one SpecSplitClient per orchestrator on one event loop. ``run`` returns
    (new token ids, rounds, accepted tokens)."""

    def __init__(self, draft, target, addrs: dict[str, str], tree: TreeSpec, timeout_s: float = 300.0):
        from specsplit.client import SpecSplitClient

        self.draft, self.target, self.tree = draft, target, tree
        self.loop = asyncio.new_event_loop()
        self.clients = {name: SpecSplitClient(addr, timeout_s=timeout_s) for name, addr in addrs.items()}
        self.pipe_target = PipeTarget()

    def wait_ready(self, timeout_s: float) -> None:
        async def go():
            for name, client in self.clients.items():
                client.start()
                deadline = time.monotonic() + timeout_s
                while not await client.ping(timeout_s=2.0):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"orchestrator {name} did not answer")

        self.loop.run_until_complete(go())

    def run(self, name: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], int, int]:
        if name in ("local", "local_2proc"):
            from specsplit.local import generate
            from specsplit.orchestrator.state import RoundStats

            stats = RoundStats()
            kw = {"make_target_engine": self.pipe_target.engine} if name == "local_2proc" else {}
            out = generate(self.draft, self.target, prompt, max_new_tokens=max_new_tokens, tree=self.tree,
                           sampling=SamplingSpec(), stats=stats, session_id="bench-local", **kw)
            return out, stats.rounds, stats.accepted
        res = self.loop.run_until_complete(self.clients[name].generate(
            prompt, max_new_tokens=max_new_tokens, sampling=SamplingSpec(), tree=self.tree))
        return res.token_ids, res.rounds, res.accepted_tokens

    def close(self) -> None:
        for client in self.clients.values():
            self.loop.run_until_complete(client.close())
        self.loop.close()
        self.pipe_target.close()


@dataclass
class _Tally:
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


def _start_fleet(tmp: Path):
    """The fleet (no growth) plus an orchestrator with tree growth on the same routers; returns
    (fleet, {system: address})."""
    from specsplit.launch import Fleet, free_ports

    fleet = Fleet.create(tmp, preset="tiny", threads=1, SPECSPLIT_GROW="false").start(drafts=1, targets=1)
    addrs = {"fleet": fleet.orchestrator}
    for name, env in (("fleet_grow", {"SPECSPLIT_GROW": "true"}),):
        port = free_ports(1)[0]
        fleet.ports[name] = port
        fleet.spawn(name, "orchestrator", env={"SPECSPLIT_ORCHESTRATOR": f"tcp://127.0.0.1:{port}", **env})
        addrs[name] = f"tcp://127.0.0.1:{port}"
    return fleet, addrs


def _time_prompts(systems: _Systems, prompts, max_new_tokens: int, log) -> tuple[dict[str, _Tally], bool]:
    """Every prompt through every system, the order rotating per prompt; (tallies, identical)."""
    for name in SYSTEMS:  # warm-up: first-call costs (allocator, sockets, engine caches) out of the timing
        systems.run(name, prompts[0], 8)
    tally = {name: _Tally() for name in SYSTEMS}
    identical = True
    for i, prompt in enumerate(prompts):
        outs = {}
        k = i % len(SYSTEMS)
        for name in SYSTEMS[k:] + SYSTEMS[:k]:
            t0 = time.perf_counter()
            outs[name], rounds, accepted = systems.run(name, prompt, max_new_tokens)
            t = tally[name]
            t.seconds += time.perf_counter() - t0
            t.tokens, t.rounds, t.accepted = t.tokens + len(outs[name]), t.rounds + rounds, t.accepted + accepted
        identical &= all(outs[name] == outs["local"] for name in SYSTEMS)
        log(f"prompt {i}: {len(prompt)} -> {len(outs['local'])} tokens, cumulative "
            + ", ".join(f"{n} {tally[n].seconds:.2f}s" for n in SYSTEMS) + f", identical={identical}")
    return tally, identical


def run_fleet_vs_local(n_prompts: int = 8, max_new_tokens: int = 64, *, tree: TreeSpec | None = None,
                       seed: int = 0, log=_log) -> dict:
    """Time the three systems prompt by prompt; tok/s = total new tokens / total seconds each."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
    import torch
    from transformers.utils import logging as hf_logging

    from specsplit.engine.base import model_vocab_size
    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    hf_logging.disable_progress_bar()
    tree = tree or TreeSpec()
    paths = resolve_model_paths(ModelSettings(preset="tiny"), progress=False)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-fleet-"))
    fleet, addrs = _start_fleet(tmp)
    systems, ok = None, False
    try:
        torch.set_num_threads(1)  # while the fleet's workers load
        draft, _ = load_model(paths.draft, dtype="float32", threads=1)
        target, _ = load_model(paths.target, dtype="float32", threads=1)
        prompts = random_prompts(n_prompts, model_vocab_size(target), seed)
        fleet.wait_ready(timeout_s=240)
        for name in ("fleet_grow",):
            fleet.wait_log(name, "orchestrator_started", timeout_s=240)
        systems = _Systems(draft, target, addrs, tree)
        systems.wait_ready(timeout_s=60)
        tally, identical = _time_prompts(systems, prompts, max_new_tokens, log)
        grow_log = fleet.log("fleet_grow")  # warm-up rounds included
        grow_rounds = grow_log.count("round_done")
        grow_hits = grow_rounds - grow_log.count("draft_reused=0")
        ok = True
    finally:
        if systems is not None:
            systems.close()
        fleet.stop()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"fleet logs kept in {tmp}")
    local = tally["local"].tok_s
    return {
        **{f"{name}_tok_s": round(tally[name].tok_s, 1) for name in SYSTEMS},
        "fleet_vs_local": round(tally["fleet"].tok_s / local, 3) if local else 0.0,
        "local_2proc_vs_local": round(tally["local_2proc"].tok_s / local, 3) if local else 0.0,
        "fleet_grow_vs_local": round(tally["fleet_grow"].tok_s / local, 3) if local else 0.0,
        "identical": identical, "prompts": n_prompts, "max_new_tokens": max_new_tokens,
        "new_tokens": {k: t.tokens for k, t in tally.items()},
        "seconds": {k: round(t.seconds, 3) for k, t in tally.items()},
        "mean_accepted": {k: round(t.mean_accepted, 2) for k, t in tally.items()},
        "grow_reused_rounds": grow_hits, "grow_rounds": grow_rounds,
        "tree": tree.model_dump(), "seed": seed, "threads": 1, "cpu_count": os.cpu_count(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }


def print_table(fleet: dict) -> None:
    print(f"{'system (tiny, 1 session, greedy)':<34}{'tok/s':>10}{'vs local':>10}{'tok/round':>10}")
    for label, key, ratio in (("in-process loop (local.generate)", "local", 1.0),
                              ("same, target in a 2nd process", "local_2proc", fleet["local_2proc_vs_local"]),
                              ("fleet, no growth", "fleet", fleet["fleet_vs_local"]),
                              ("fleet, tree growth", "fleet_grow", fleet["fleet_grow_vs_local"])):
        print(f"{label:<34}{fleet[f'{key}_tok_s']:>10.1f}{ratio:>9.3f}x{fleet['mean_accepted'][key]:>10.2f}")
    print(f"prompts={fleet['prompts']} max_new_tokens={fleet['max_new_tokens']} identical={fleet['identical']} "
          f"goal: fleet >= 0.9x, fleet+growth > 1.0x  load avg {fleet['load_avg_before']} -> "
          f"{fleet['load_avg_after']} on {fleet['cpu_count']} cpus")
