"""Launch a local fleet as real processes on loopback (routers, workers, orchestrator).

Used by the system tests (tiny preset, random free ports), ``specsplit bench`` and the demo.
Every process is started in its own process group and stopped by pid (SIGTERM, then SIGKILL).
Each role's command is a supervisor with the working child beside it (specsplit.supervise), so
``kill9`` (the whole group) removes a role for good, as a crashed machine would; killing only
the child lets the supervisor bring it back.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PORT_FLOOR = 10000  # free_ports draws from here up to the ephemeral range
MAX_GIVEN = 8192  # ports free_ports remembers handing out (the most recent)
_given: dict[int, None] = {}  # ports handed out by this process, oldest first: never handed out again


def reserve(ports) -> None:
    """Marks ``ports`` as handed out (a range a process derives its ports from: the metrics
    base's roles), so ``free_ports`` in this process draws none of them."""
    for p in ports:
        _given.pop(p, None)
        _given[p] = None
    while len(_given) > MAX_GIVEN:
        del _given[next(iter(_given))]


def handed_out(port: int) -> bool:
    return port in _given


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (the local ports of outgoing connections
    and of binds to port 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, avoid: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """``n`` distinct ports free on loopback now, for processes that bind them later, none in
    ``avoid`` and none this process handed out before (``reserve``): those may still be unbound
    (seen in CI: a test fleet's orchestrator drew its target router's port from a second call,
    and a bench fleet's API port was another fleet's metrics port). Drawn below the kernel's ephemeral range
    where it leaves room: a port in that range can become another connection's local port between
    this check and a role's bind seconds later (seen in CI: a metrics port taken, its scrape
    refused); below it only an explicit bind can take it."""
    socks, ports = [], []
    low = ephemeral_low()
    rng = random.SystemRandom()
    try:
        for _ in range(50 * n if low - 1000 > PORT_FLOOR else 0):
            if len(ports) == n:
                break
            port = rng.randrange(PORT_FLOOR, low - 1)
            if port in ports or port in avoid or port in _given or not port_is_free(port):
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # no room below the range (or none free there): the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)  # (held until the end: the kernel gives it to no other bind meanwhile)
            if s.getsockname()[1] not in avoid and s.getsockname()[1] not in _given:
                ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    reserve(ports)
    return ports


def port_is_free(port: int) -> bool:
    """No socket LISTENs on the port (TIME_WAIT leftovers of closed connections don't count)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                return False
    with socket.socket() as s:  # and the port can be bound again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _die_with_parent() -> None:
    """In a launched child, before exec (Linux): SIGTERM when the launching process dies, even
    by SIGKILL or the OOM killer, so a killed test or bench leaves no fleet holding the cores
    and memory. Elsewhere a no-op (``Fleet.stop`` still stops it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(143)


@dataclass
class Fleet:
    tmp: Path
    env: dict = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics: bool = False  # each process serves Prometheus text on its own free port (metrics_ports)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, tmp: Path, preset: str = "tiny", threads: int = 1, metrics: bool = False, **extra_env) -> Fleet:
        """A fleet whose processes get exactly this environment: the launcher's (holding whatever env
        file its own ``specsplit`` command applied) with the pins below and ``extra_env`` over it.
        They read no env file (SPECSPLIT_ENV_FILE empty, specsplit.envfile): from the repository
        root a test fleet would otherwise take the real models' .env (int8 kernels) over its pins.
        They run in the launcher's directory, so the relative paths it passes keep their meaning."""
        names = ["draft_fe", "draft_be", "target_fe", "target_be", "orch"]
        ports = dict(zip(names, free_ports(len(names))))
        addr = {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}
        tmp.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "SPECSPLIT_PRESET": preset,
            "OMP_WAIT_POLICY": "PASSIVE",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "SPECSPLIT_THREADS": str(threads),
            "SPECSPLIT_PREFILL_THREADS": str(threads),
            "SPECSPLIT_LOG_LEVEL": "INFO",
            "SPECSPLIT_DRAFT_BACKEND": addr["draft_be"],
            "SPECSPLIT_TARGET_BACKEND": addr["target_be"],
            "SPECSPLIT_ORCHESTRATOR": addr["orch"],
            "SPECSPLIT_DRAFT_ROUTER": addr["draft_fe"],
            "SPECSPLIT_TARGET_ROUTER": addr["target_fe"],
            "SPECSPLIT_MAX_ATTEMPTS": "30",
            "SPECSPLIT_RPC_TIMEOUT_S": "300",
            # metrics off unless asked: test fleets must not take the fleet-wide scheme's ports
            "SPECSPLIT_METRICS_PORT": "0",
            # the fleet's own secret file (created 0600 by its first process), unless one is configured
            "SPECSPLIT_FLEET_SECRET_FILE": os.environ.get("SPECSPLIT_FLEET_SECRET_FILE") or str(tmp / "fleet.secret"),
            "SPECSPLIT_ENV_FILE": "",  # no .env of the working directory over the pins (see above)
            **{k: str(v) for k, v in extra_env.items()},
        }
        return cls(tmp=tmp, env=env, ports=ports, metrics=metrics)

    @property
    def orchestrator(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['orch']}"

    def secret(self) -> bytes:
        """The fleet secret its processes prove (what an insider, e.g. another orchestrator, holds)."""
        from brokers.auth import load_fleet_secret

        return load_fleet_secret(self.env.get("SPECSPLIT_FLEET_SECRET"), self.env["SPECSPLIT_FLEET_SECRET_FILE"])

    def addr(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[name]}"

    def spawn(self, name: str, *args: str, env: dict | None = None, prefix: tuple[str, ...] = (),
              module: str = "specsplit") -> subprocess.Popen:
        """Start ``python -m MODULE ARGS`` (after ``prefix``, e.g. ``ip netns exec NS``, which
        execs it: the pid stays the role's)."""
        env = dict(env or {})
        if self.metrics:  # a respawned name keeps its port
            taken = {*self.ports.values(), *self.metrics_ports.values()}
            port = self.metrics_ports.setdefault(name, free_ports(1, avoid=taken)[0])
            env.setdefault("SPECSPLIT_METRICS_BIND_PORT", str(port))
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", module, *args], env={**self.env, **env},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        log.close()
        self.procs[name] = proc
        return proc

    def start_routers(self) -> Fleet:
        self.spawn("router_draft", "router", "draft", "--frontend", self.addr("draft_fe"), "--backend", self.addr("draft_be"))
        self.spawn("router_target", "router", "target", "--frontend", self.addr("target_fe"), "--backend", self.addr("target_be"))
        return self

    def start(self, drafts: int = 1, targets: int = 1) -> Fleet:
        self.start_routers()
        for i in range(drafts):
            self.spawn(f"draft{i}", "draft", env={"SPECSPLIT_WORKER_ID": f"draft-{i}"})
        for i in range(targets):
            self.spawn(f"target{i}", "target", env={"SPECSPLIT_WORKER_ID": f"target-{i}"})
        self.spawn("orchestrator", "orchestrator")
        return self

    def scrape(self, name: str, timeout_s: float = 10.0) -> dict[str, float]:
        """Process ``name``'s metrics (``metrics=True``): {'name{label="v",...}': value}."""
        return scrape(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout_s)

    def log(self, name: str) -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def wait_log(self, name: str, needle: str, count: int = 1, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.log(name).count(needle) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never logged {needle!r} x{count}:\n{self.log(name)[-3000:]}")
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            time.sleep(0.2)

    def wait_ready(self, drafts: int = 1, targets: int = 1, timeout_s: float = 240.0) -> None:
        self.wait_log("router_draft", "worker_admitted", drafts, timeout_s)
        self.wait_log("router_target", "worker_admitted", targets, timeout_s)
        self.wait_log("orchestrator", "orchestrator_started", 1, timeout_s)

    def restart_orchestrator(self, timeout_s: float = 60.0) -> None:
        """Stop the orchestrator (SIGTERM, SIGKILL past ``timeout_s``) and start a fresh one on the
        same address: nothing it learned (the n-gram cache, the cost model) carries over, as
        after a redeploy. Returns once the new one has started; clients reconnect by themselves."""
        proc, started = self.procs["orchestrator"], self.log("orchestrator").count("orchestrator_started")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9("orchestrator")
        self.spawn("orchestrator", "orchestrator")
        self.wait_log("orchestrator", "orchestrator_started", started + 1, timeout_s)

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, timeout_s: float = 20.0) -> dict[str, int]:
        """SIGTERM every process by pid, then SIGKILL stragglers; returns exit codes."""
        codes = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[name] = proc.wait(timeout=10)
        return codes


def spread_session_ids(n: int, worker_ids: list[str], prefix: str = "s") -> list[str]:
    """``n`` session ids the routers place on ``worker_ids`` in turn (the rendezvous hash they
    route by), so every worker serves some: random ids all land on one of two workers 1 time in
    2**(n-1)."""
    from brokers.rendezvous import pick

    if not worker_ids:
        raise ValueError("no workers to spread sessions over")
    keys = [w.encode() for w in worker_ids]
    ids, k = [], 0
    while len(ids) < n:
        sid, k = f"{prefix}-{k}", k + 1
        if pick(sid, keys) == keys[len(ids) % len(keys)]:
            ids.append(sid)
    return ids


async def generate_all(addr: str, prompts, max_new_tokens: int, session_ids=None, **kw):
    """Every prompt generated at once through one client; ``session_ids`` (one a prompt) places
    the sessions on chosen workers (the routers hash them), else each gets a random id."""
    from specsplit.client import SpecSplitClient

    ids = list(session_ids) if session_ids is not None else [None] * len(prompts)
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} session ids for {len(prompts)} prompts")
    async with SpecSplitClient(addr, timeout_s=180) as client:
        return await asyncio.gather(*(client.generate(p, max_new_tokens=max_new_tokens, session_id=sid, **kw)
                                      for p, sid in zip(prompts, ids)))


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """GET a Prometheus text page: {'name{label="v",...}': value} (labels sorted; no braces
    without labels)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
