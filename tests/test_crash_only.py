"""Crash-only fleet: real ``honcho start`` with supervised roles, kill -9 of the processes doing
the work while a producer streams; and a router that is away for 10 s. Tiny preset, free ports.

The killed processes are the python processes doing each role's work (the supervised children,
found through /proc: cmdline, parent pid, HONCHO_PROCESS_NAME), never the supervisors or shells.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from specsplit.launch import Fleet, port_is_free
from tests.conftest import KillAfterTokens, greedy_cached, wait_until
from tests.honcho_fleet import honcho_fleet as _honcho_fleet, honcho_log as _log, stop_honcho as _stop_honcho
from tests.honcho_fleet import descendants, worker_pid as _worker_pid

pytestmark = [pytest.mark.system, pytest.mark.slow]
_wait = wait_until  # (pred, timeout_s, what); every wait here guards a hang: a starved box is 4x slower


@pytest.fixture(scope="module")
def target_model():
    import torch

    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    torch.set_num_threads(1)
    model, _ = load_model(resolve_model_paths(ModelSettings(preset="tiny")).target)
    return model


def _produce(tmp: Path, env: dict, prompts: list[str], *, max_new_tokens: int, rounds: int,
             concurrency: int | None = None) -> subprocess.Popen:
    """``specsplit produce --json`` of ``prompts`` (all at once, or ``concurrency`` at a time)
    into tmp/produce.out and .err, returned once the fleet has logged ``rounds`` more rounds (or
    the producer ended)."""
    (tmp / "prompts.txt").write_text("\n".join(prompts) + "\n")
    rounds_before = _log(tmp).count("round_done")
    out, err = open(tmp / "produce.out", "wb"), open(tmp / "produce.err", "wb")
    producer = subprocess.Popen(
        [sys.executable, "-m", "specsplit", "produce", "--file", str(tmp / "prompts.txt"), "--json",
         "--concurrency", str(concurrency or len(prompts)), "--max-new-tokens", str(max_new_tokens), "--chat", "off",
         "--wait-s", "60"],
        env=env, stdout=out, stderr=err, start_new_session=True)
    out.close()
    err.close()
    _wait(lambda: _log(tmp).count("round_done") > rounds_before + rounds or producer.poll() is not None,
          240, "the prompts are being served")
    return producer


# the honcho fleet's processes: two routers, two drafts, two targets, two orchestrators, the API
FLEET_ROLES = 9
PROMPTS = [f"{'abc xyz '[i % 7:]}{i} def f{i}(x): return x * {i}" + " ." * (i % 5) for i in range(16)]


@pytest.mark.timeout(900)  # ~70 s on an idle 2-core box; the ceiling is for a starved one
def test_honcho_fleet_survives_kill9_of_every_role(tmp_path, target_model):
    proc, ports, env = _honcho_fleet(tmp_path)
    try:
        _wait(lambda: _log(tmp_path).count("worker_admitted") >= 8 and _log(tmp_path).count("orchestrator_started") >= 2,
              300, "fleet ready")  # each worker logs worker_admitted, and each router too: 4 + 4
        t0 = time.monotonic()
        # 16 x 200 tokens: ~1,000 rounds, ten times the 96 the kills below wait for
        producer = _produce(tmp_path, env, PROMPTS, max_new_tokens=200, rounds=32)
        killed, killed_at = [], {}
        for slot in ("target.1", "draft.2", "router_target.1", "orchestrator.1"):
            # fault injection on an event: each kill after 16 more rounds were served (or the
            # producer ended), never after a fixed sleep that a faster machine outruns
            rounds = _log(tmp_path).count("round_done")
            _wait(lambda rounds=rounds: _log(tmp_path).count("round_done") >= rounds + 16 or producer.poll() is not None,
                  120, "16 more rounds")
            if producer.poll() is not None:
                break
            pid = _worker_pid(proc.pid, slot)
            killed_at[slot] = time.time()  # (before the kill: whatever noticed it logged after)
            os.kill(pid, signal.SIGKILL)
            killed.append((slot, round(time.monotonic() - t0, 1)))
        rc = producer.wait(timeout=480)
        took = time.monotonic() - t0
        stdout = (tmp_path / "produce.out").read_text()
        stderr = (tmp_path / "produce.err").read_text()
        assert rc == 0, stderr[-3000:]
        assert len(killed) == 4, f"the run ended before every kill: {killed}"
        assert proc.poll() is None, "honcho stopped the fleet:\n" + _log(tmp_path)[-3000:]
        rows = sorted((json.loads(line) for line in stdout.splitlines()), key=lambda r: r["index"])
        assert len(rows) == len(PROMPTS)
        for r in rows:
            ref, _ = greedy_cached(target_model, r["prompt_token_ids"], len(r["token_ids"]))
            assert r["token_ids"] == ref, r["index"]
            assert r["finish_reason"] in ("stop", "length")
            assert r["finish_reason"] == "stop" or r["new_tokens"] == 200
        log = _log(tmp_path)
        assert log.count("role_died") >= 4, log[-3000:]
        print(f"kills at {killed}; produce finished in {took:.1f}s; resumes {sum(r['resumes'] for r in rows)}; "
              f"{log.count('round_done')} rounds")
        # the survivors noticed: orchestrators the router's loss, the producer the orchestrator's;
        # how fast is printed, not bounded (a starved box notices later)
        assert "router_lost" in log and "orchestrator_lost" in stderr
        router_lost = _stamp(log, "router_lost") - killed_at["router_target.1"]
        orch_lost = _stamp(stderr, "orchestrator_lost") - killed_at["orchestrator.1"]
        print(f"router kill -> router_lost {router_lost:.3f}s; orchestrator kill -> producer's orchestrator_lost "
              f"{orch_lost:.3f}s")
        # every role came back: the killed slots are served by fresh children
        for slot, _ in killed:
            _wait(lambda slot=slot: _worker_pid(proc.pid, slot), 120, f"{slot} restarted")
    finally:
        tree = descendants(proc.pid)
        _stop_honcho(proc)
    # honcho itself exits 143 after a SIGTERM (its convention); every role drained and exited 0
    assert proc.returncode in (0, 143), _log(tmp_path)[-3000:]
    stopped = [ln for ln in _log(tmp_path).splitlines() if "role_stopped" in ln]
    # every role drained and exited within honcho's 5 s between SIGTERM and SIGKILL (a supervisor
    # SIGKILLed by honcho logs nothing): a worker ends its process once its drain is done instead
    # of spending a second of CPU on the interpreter's teardown (specsplit.cli._exit_now), which
    # with nine roles stopping at once on a starved box outlasted the window (seen in ~1 of 4 runs)
    diag = "\n".join(stopped) + "\n" + _log(tmp_path)[-8000:]
    assert len(stopped) == FLEET_ROLES and all("rc=0" in ln for ln in stopped), diag
    try:  # children killed with their supervisor exit a moment after it: wait for it (a hang guard)
        _wait(lambda: not _alive(tree), 30, "every process of the fleet gone")
    except TimeoutError:
        raise AssertionError([tree[p][1] for p in _alive(tree)]) from None
    _wait_ports_free(ports)


def _alive(tree: dict) -> list[int]:
    """The pids of ``tree`` still running (a zombie is gone)."""
    out = []
    for pid in tree:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except (OSError, IndexError):
            pass
    return out


def _wait_ports_free(ports: dict[str, int]) -> None:
    for name, port in ports.items():
        _wait(lambda port=port: port_is_free(port), 30, f"{name} port {port} freed")


def _stamp(text: str, event: str, nth: int = 1) -> float:
    """Epoch seconds of the nth structlog line with ``event`` (ISO timestamps, UTC)."""
    from datetime import datetime, timezone

    lines = [ln for ln in text.splitlines() if event in ln]
    stamp = next(w for w in lines[nth - 1].split() if w.endswith("Z") and "T" in w).rstrip("Z")
    return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()


@pytest.mark.timeout(480)
def test_router_away_10s_then_back_run_finishes_exact_waiting_out_no_timeout(tmp_path, target_model):
    import asyncio

    from specsplit.launch import generate_all
    from tests.test_system import prompts

    fleet = Fleet.create(tmp_path, SPECSPLIT_MAX_ATTEMPTS="8", SPECSPLIT_RPC_TIMEOUT_S="60")
    fleet.start(drafts=1, targets=1)
    try:
        fleet.wait_ready(drafts=1, targets=1)
        ps = prompts(8, seed=21)

        async def run():
            # fault injection on an event, not after a sleep: the router dies from inside the
            # stream callback once 40 tokens have arrived, so the run is certainly under way
            kill = KillAfterTokens(lambda: fleet.kill9("router_target"), 40)
            task = asyncio.ensure_future(generate_all(fleet.orchestrator, ps, 160, on_tokens=kill))
            await asyncio.wait_for(kill.done.wait(), 120)
            assert kill.streamed < len(ps) * 160, "the run ended before the router went away"
            await asyncio.sleep(10.0)  # the outage under test: wall-clock time passing is the point
            fleet.spawn("router_target", "router", "target", "--frontend", fleet.addr("target_fe"),
                        "--backend", fleet.addr("target_be"))
            back = time.monotonic()
            results = await asyncio.wait_for(task, 300)  # a hang guard, not a speed bound
            return results, time.monotonic() - back

        results, after_back = asyncio.run(run())
        for p, r in zip(ps, results):
            assert r.token_ids == greedy_cached(target_model, p, 160)[0]
        orch = fleet.log("orchestrator")
        assert "router_lost" in orch and "router_back" in orch
        restarted = _stamp(fleet.log("router_target"), "router_started", nth=2)
        first_round = min(_stamp(line, "round_done") for line in orch.splitlines()
                          if "round_done" in line and _stamp(line, "round_done") > restarted)
        print(f"router back -> first round done {first_round - restarted:.2f}s; run finished {after_back:.1f}s "
              f"after the router came back")
        # fast means on events, whatever the box's speed: the loss and the return failed the calls
        # in flight at once, so no request waited out its 60 s timeout (a retry says why it came)
        retries = [ln for ln in orch.splitlines() if "request_retry" in ln]
        assert not [ln for ln in retries if re.search(r"reason\W+timeout\b", ln)], retries[:5]
    finally:
        codes = fleet.stop(timeout_s=120)  # SIGKILL only past a hang guard: a slow drain still exits 0
    assert all(c == 0 for c in codes.values()), codes


LOOKUP_PROMPTS = [" ".join([f"def f{i}(x): return x + {i}"] * 4) for i in range(8)]  # lookup finds candidates
# new tokens a prompt: many times the rounds the kill waits for (printed; the tiny pair's lookup
# adds ~1 token a round, SmolLM2 on these prompts ~6)
LOOKUP_NEW_TOKENS, LLAMACPP_NEW_TOKENS = 80, 160


def _kill_a_target_mid_stream(tmp: Path, proc: subprocess.Popen, env: dict, rounds: int,
                              max_new_tokens: int) -> list[dict]:
    """A draft-less fleet (two targets, one orchestrator) once ready: ``LOOKUP_PROMPTS`` produced
    (``max_new_tokens`` each), after ``rounds`` rounds the worker process of a target slot that
    serves one of them SIGKILLed; the producer must finish and honcho keep running. (The produced
    rows, in prompt order; the slot killed.)"""
    # two target workers and the target router's two admissions; the draft router stays empty
    _wait(lambda: _log(tmp).count("worker_admitted") >= 4 and "orchestrator_started" in _log(tmp),
          300, "fleet ready")
    producer = _produce(tmp, env, LOOKUP_PROMPTS, max_new_tokens=max_new_tokens, rounds=rounds)
    assert producer.poll() is None, "the run ended before the kill"
    slot = _serving_target_slot(_log(tmp), ("target.1", "target.2"), max_new_tokens=max_new_tokens)
    os.kill(_worker_pid(proc.pid, slot), signal.SIGKILL)
    rc = producer.wait(timeout=480)
    assert rc == 0, (tmp / "produce.err").read_text()[-3000:]
    print(f"killed {slot} after {rounds} rounds; {_log(tmp).count('round_done')} in all")
    assert proc.poll() is None, "honcho stopped the fleet:\n" + _log(tmp)[-3000:]
    rows = sorted((json.loads(line) for line in (tmp / "produce.out").read_text().splitlines()),
                  key=lambda r: r["index"])
    assert len(rows) == len(LOOKUP_PROMPTS)
    return rows, slot


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serving_target_slot(log: str, slots: tuple[str, ...], before: str = "",
                         max_new_tokens: int | None = None) -> str:
    """The first of ``slots`` that the target router's rendezvous hash gives a session of the
    rounds logged so far (worker identities are ``target-<slot>``): random session ids all land on
    one of two workers 1 time in 2**(n-1), and a kill of the other one would test nothing. Only
    sessions past their first round that ``before`` (the log before this run) does not name
    count, where there are any: not the producer's one-token probe, nor an earlier run's session
    whose last round was logged after it ended (an orchestrator logs a round once the next one
    is under way, or after the session's end was sent). Given ``max_new_tokens``, the slot whose
    sessions have the most tokens left to generate (each round adds its accepted tokens and one
    of the target's): a fast run can finish a slot's few sessions before the kill lands."""
    from brokers.rendezvous import pick

    earlier = set(re.findall(r"round_done\b.*?\bsession_id\W+(\w+)", before))
    rounds = [(int(acc), int(rnd), sid) for acc, rnd, sid in re.findall(
        r"round_done\b.*?\baccepted=(\d+).*?\bround=(\d+).*?\bsession_id\W+(\w+)", log) if sid not in earlier]
    going = {sid for _, rnd, sid in rounds if rnd >= 1}
    sessions = going or {sid for *_, sid in rounds} or set(re.findall(r"round_done\b.*?\bsession_id\W+(\w+)", log))
    keys = [f"target-{slot}".encode() for slot in slots]
    if max_new_tokens is not None and going:
        made = Counter()
        for acc, _, sid in rounds:
            made[sid] += acc + 1
        left = Counter()
        for sid in going:
            left[pick(sid, keys)] += max(0, max_new_tokens - made[sid])
        return max(zip(slots, keys), key=lambda sk: left[sk[1]])[0]
    served = {pick(sid, keys) for sid in sessions}
    return next(slot for slot, key in zip(slots, keys) if key in served)


# ~3,400 SmolLM2 tokens, one line: seconds of prefill for a one-thread fp32 target
LONG_PROMPT = " ".join(f"item {i} costs {i * 7 % 100} dollars;" for i in range(320))


@pytest.mark.timeout(900)  # ~60 s on an idle 2-core box; the ceiling is for a starved one
def test_a_target_killed_mid_prefill_of_a_long_prompt_is_resent_not_waited_out(tmp_path):
    """A long prompt's first verify brings the target ~3,400 tokens to prefill (seconds for the
    fp32 SmolLM2 target on one thread), and a worker request may take SPECSPLIT_RPC_TIMEOUT_S
    plus SPECSPLIT_RPC_TIMEOUT_PER_TOKEN_S a token: here 300 + 170 s. The target worker doing that
    prefill (its CPU time growing, no round of the prompt logged) is SIGKILLed under honcho: the
    router fails the request in flight at once (the worker expired or registered again), the
    orchestrator sends the prompt again, and the answer is the target's greedy decoding. A
    recovery that waited out the timeout would log ``reason=timeout``; none may. The session stays
    on the worker that prefilled it when the killed slot's new process registers (the router's
    placements), so the prompt is prefilled twice in all, not three times."""
    from specsplit.models import load_model

    out = subprocess.run([sys.executable, "-m", "specsplit", "models", "path", "smollm2"], capture_output=True,
                         text=True, timeout=900, check=True)
    target = json.loads(out.stdout)["target"]
    proc, ports, env = _honcho_fleet(tmp_path, "draft=0,target=2,orchestrator=1", SPECSPLIT_PRESET="smollm2",
                                     SPECSPLIT_SPECULATOR="lookup", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                     SPECSPLIT_RPC_TIMEOUT_S="300")
    try:
        _wait(lambda: _log(tmp_path).count("worker_admitted") >= 4 and "orchestrator_started" in _log(tmp_path),
              300, "fleet ready")
        slots = ("target.1", "target.2")
        pids = {slot: _worker_pid(proc.pid, slot) for slot in slots}
        start = {slot: _cpu_s(pid) for slot, pid in pids.items()}
        producer = _produce(tmp_path, env, [LONG_PROMPT], max_new_tokens=24, rounds=-1)

        def prefilling() -> str | None:  # the slot whose worker is at it, before the prompt's round
            if re.search(r"round_done .*batch_tokens=\d{4}", _log(tmp_path)):
                raise AssertionError("the prefill ended before the kill: " + _log(tmp_path)[-2000:])
            busy = {slot: _cpu_s(pid) - start[slot] for slot, pid in pids.items()}
            slot = max(busy, key=busy.get)
            return slot if busy[slot] > 0.5 else None

        slot = wait_until(prefilling, 240, "a target prefilling the long prompt")
        os.kill(pids[slot], signal.SIGKILL)
        assert producer.wait(timeout=480) == 0, (tmp_path / "produce.err").read_text()[-3000:]
        log = _log(tmp_path)
        assert "role_died" in log and "reason=timeout" not in log and "reason='timeout" not in log, log[-3000:]
        assert re.search(r"request_retry .*with the request in flight|request_resent", log), log[-3000:]
        # prefilled once more, on the other worker, where the session stays when the slot's new
        # process comes: no CACHE_MISS, no third prefill
        assert len(re.findall(r"round_done .*batch_tokens=\d{4}", log)) == 1 and "cache_miss" not in log, log[-3000:]
        row = json.loads((tmp_path / "produce.out").read_text().splitlines()[0])
        _wait(lambda: _worker_pid(proc.pid, slot), 120, f"{slot} restarted")
    finally:
        _stop_honcho(proc)
    assert proc.returncode in (0, 143), _log(tmp_path)[-3000:]
    assert len(row["prompt_token_ids"]) > 3000
    got = row["token_ids"]
    want, gap = greedy_cached(load_model(Path(target), dtype="float32")[0], row["prompt_token_ids"], len(got))
    assert got == want and (row["finish_reason"] == "stop" or len(got) == 24), (row, want, gap)
    _wait_ports_free(ports)


@pytest.mark.timeout(900)  # ~40 s on an idle 2-core box; the ceiling is for a starved one
def test_lookup_only_honcho_fleet_with_no_draft_worker_survives_kill9_of_a_target(tmp_path, target_model):
    """SPECSPLIT_SPECULATOR=lookup started as the README says (`honcho start -c draft=0`): no draft
    worker at all; a kill -9 of a target worker's process mid-stream costs a resend, not an answer,
    and honcho keeps the fleet up and restarts the slot."""
    proc, ports, env = _honcho_fleet(tmp_path, "draft=0,target=2,orchestrator=1", SPECSPLIT_SPECULATOR="lookup",
                                     SPECSPLIT_ORCHESTRATOR_COUNT="1")
    try:
        rows, slot = _kill_a_target_mid_stream(tmp_path, proc, env, rounds=16, max_new_tokens=LOOKUP_NEW_TOKENS)
        for r in rows:
            ref, _ = greedy_cached(target_model, r["prompt_token_ids"], len(r["token_ids"]))
            assert r["token_ids"] == ref, r["index"]
            assert r["finish_reason"] == "stop" or r["new_tokens"] == LOOKUP_NEW_TOKENS
        assert sum(r["drafted_tokens"] for r in rows) > 0  # lookup candidates were verified
        log = _log(tmp_path)
        assert "role_died" in log, log[-3000:]
        assert not re.search(r"(?m)^\S+ draft\.\d+ +\|", log), "honcho started a draft worker"
        _wait(lambda: _worker_pid(proc.pid, slot), 120, f"{slot} restarted")
    finally:
        _stop_honcho(proc)
    assert proc.returncode in (0, 143), _log(tmp_path)[-3000:]
    _wait_ports_free(ports)


@pytest.mark.timeout(1200)  # the ceiling is for a starved box
def test_llamacpp_honcho_fleet_survives_kill9_of_a_target_mid_batch(tmp_path):
    """The llama.cpp engines started as people start a fleet (`honcho start`, the Procfile, the
    .env with SPECSPLIT_TARGET_ENGINE=llamacpp; real SmolLM2 GGUF, prompt lookup, no draft worker),
    8 sessions verified in shared decodes on two target workers; a kill -9 of one target mid-stream
    costs its sessions a resend, not an answer. llama.cpp's kernels round a multi-token forward
    differently from a one-token one, so each answer is checked against the target's own greedy
    decoding with every divergence explained (`LlamaTargetRunner.divergence`: a near-tie or a flip
    by the forward's shape), not for bit equality."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the gguf extra: ./ops/setup.sh gguf")
    from specsplit.bench.systems import LlamaTargetRunner
    from specsplit.models import ModelSettings
    from specsplit.models.loading import resolve_gguf

    gguf = resolve_gguf("target", ModelSettings(preset="smollm2"))
    proc, ports, env = _honcho_fleet(tmp_path, "draft=0,target=2,orchestrator=1", SPECSPLIT_PRESET="smollm2",
                                     SPECSPLIT_TARGET_ENGINE="llamacpp", SPECSPLIT_SPECULATOR="lookup",
                                     SPECSPLIT_ORCHESTRATOR_COUNT="1")
    try:
        rows, slot = _kill_a_target_mid_stream(tmp_path, proc, env, rounds=24, max_new_tokens=LLAMACPP_NEW_TOKENS)
        log = _log(tmp_path)
        assert "role_died" in log, log[-3000:]
        # sent again: by the orchestrator (request_resent: the router lost, a CACHE_MISS), or after
        # the router failed the requests it had in flight on the dead worker (request_retry)
        assert re.search(r"request_resent|request_retry .*with the request in flight", log), \
            "no request in flight on the killed target was resent"
        assert sum(r["drafted_tokens"] for r in rows) > 0  # lookup candidates were verified
        batched = [int(m) for m in re.findall(r"round_done .* batch_size=(\d+)", log)]
        assert max(batched) > 1, "no two sessions shared a decode"
        _wait(lambda: _worker_pid(proc.pid, slot), 120, f"{slot} restarted")
    finally:
        _stop_honcho(proc)
    assert proc.returncode in (0, 143), _log(tmp_path)[-3000:]
    reference = LlamaTargetRunner(gguf, threads=1, stop_ids=[])
    try:
        for r in rows:
            assert r["finish_reason"] == "stop" or r["new_tokens"] == LLAMACPP_NEW_TOKENS, r
            got, ids = r["token_ids"], r["prompt_token_ids"]
            want = reference.target_alone(ids, len(got)).token_ids
            if want != got:
                k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                why = reference.divergence(ids, want, got, k)
                assert why["named"], (r["index"], why)
                print(f"prompt {r['index']}: diverges at {k}: {why['cause']}")
    finally:
        reference.close()
    print(f"rounds by batch size: {dict(sorted(Counter(batched).items()))}")
    _wait_ports_free(ports)
