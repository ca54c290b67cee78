"""A fleet spread over Linux network namespaces: one "host" per role, CURVE on every socket.

Used by tests/test_multihost.py (tiny preset) and ``specsplit bench netem`` (any preset). Needs
root and iproute2 (``ip netns``, veth; ``tc netem`` for link delays, or the target's
``specsplit.delayrelay`` where the kernel has no sch_netem). Everything it makes is private to
namespaces it creates: a hub namespace holds a bridge, and each host namespace (routers, draft,
target, orchestrator, client) gets one veth whose other end is on that bridge, with an address
in ``10.213.<net>.0/24``. Nothing is added to, or changed on, the caller's own namespace.
``NetnsLab.close`` deletes every namespace it made (call it in a ``finally``).

Processes run as ``ip netns exec NS python -m specsplit ROLE`` (specsplit.launch.Fleet). The
producer runs in the client namespace too: ``python -m specsplit.netns produce`` prints the
results as one JSON line. No torch here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from specsplit.launch import Fleet

HOSTS = ("routers", "draft", "target", "orch", "client")
PORTS = {"draft_fe": 5550, "draft_be": 5551, "target_fe": 5560, "target_be": 5561, "orch": 5570, "target_relay": 6561}
_IP_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message holds ip's stderr)."""


def _ip(*args: str) -> None:
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"ip {' '.join(args)}: {exc}") from exc
    if out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")


def netns_unavailable() -> str | None:
    """Why namespaced fleets cannot run here (None: they can): not root, no iproute2 / tc, or
    ``ip netns add`` refused (a container without CAP_SYS_ADMIN)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"ssprobe{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"ip netns add is not permitted here: {exc}"
    try:
        _ip("netns", "del", probe)
    except NetnsError as exc:
        return f"ip netns del failed: {exc}"
    return None


def netem_unavailable() -> str | None:
    """Why ``tc qdisc ... netem`` cannot run here (None: it can); some kernels lack sch_netem."""
    why = netns_unavailable()
    if why:
        return why
    probe = f"ssprobe{uuid.uuid4().hex[:8]}"
    _ip("netns", "add", probe)
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        _ip("netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except NetnsError as exc:
        return f"tc netem is not available (kernel without sch_netem?): {exc}"
    finally:
        _ip("netns", "del", probe)
    return None


class NetnsLab:
    """The namespaces and links; ``addr[host]`` is each host's IPv4 address."""

    def __init__(self, net: int = 7) -> None:
        if not 0 <= net <= 255:
            raise ValueError("net is the third octet of 10.213.<net>.0/24")
        self.tag = uuid.uuid4().hex[:6]
        self.ns = {h: f"ss{self.tag}-{h}" for h in ("hub", *HOSTS)}
        self.addr = {h: f"10.213.{net}.{i}" for i, h in enumerate(HOSTS, start=1)}
        self.made: list[str] = []

    def __enter__(self) -> NetnsLab:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> NetnsLab:
        try:
            for name in self.ns.values():
                _ip("netns", "add", name)
                self.made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            hub = self.ns["hub"]
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "link", "set", "br0", "up")
            for i, host in enumerate(HOSTS):
                # made inside the hub, its peer straight into the host namespace: never in ours
                _ip("-n", hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", self.ns[host])
                _ip("-n", hub, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", self.ns[host], "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
                _ip("-n", self.ns[host], "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_prefix(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns[host])

    def netem(self, host: str, delay_ms: float) -> None:
        """Delay everything ``host`` sends by ``delay_ms`` (0: remove the delay)."""
        ns = self.ns[host]
        if delay_ms > 0:
            _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms")
        else:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=_IP_TIMEOUT_S)  # none there yet is fine

    def close(self) -> None:
        errors = []
        for name in reversed(self.made):
            try:
                _ip("netns", "del", name)
            except NetnsError as exc:
                errors.append(str(exc))
        self.made.clear()
        if errors:
            raise NetnsError("; ".join(errors))


def make_keys(key_dir: Path) -> dict[str, Path]:
    """One fleet server keypair (routers and orchestrator) and one per client; ``authorized/``
    holds the admitted public keys. A ``stranger`` keypair is made but not admitted."""
    from brokers.curve import write_keypair

    paths = {}
    for name in ("server", "draft", "target", "client", "stranger"):
        public, secret = write_keypair(key_dir, name)
        paths[name], paths[f"{name}.pub"] = secret, public
    authorized = key_dir / "authorized"
    authorized.mkdir(mode=0o700)
    for name in ("server", "draft", "target", "client"):
        shutil.copy(paths[f"{name}.pub"], authorized / f"{name}.key")
    paths["authorized"] = authorized
    return paths


class NetnsFleet:
    """Routers, one draft and one target worker and the orchestrator, each in its own namespace,
    CURVE on; ``produce`` runs prompts from the client namespace."""

    def __init__(self, lab: NetnsLab, tmp: Path, preset: str = "tiny", threads: int = 1, relay: bool = False,
                 **extra_env) -> None:
        """``relay``: the target worker reaches its router through ``specsplit.delayrelay`` in
        its own namespace, whose delay ``set_target_delay`` sets (kernels without sch_netem);
        otherwise ``set_target_delay`` puts a netem qdisc on the target host's link."""
        self.lab, self.tmp, self.relay = lab, tmp, relay
        self._relay: subprocess.Popen | None = None
        self.keys = make_keys(tmp / "keys")
        a = lab.addr
        addrs = {
            "SPECSPLIT_DRAFT_ROUTER": f"tcp://{a['routers']}:{PORTS['draft_fe']}",
            "SPECSPLIT_DRAFT_BACKEND": f"tcp://{a['routers']}:{PORTS['draft_be']}",
            "SPECSPLIT_TARGET_ROUTER": f"tcp://{a['routers']}:{PORTS['target_fe']}",
            "SPECSPLIT_TARGET_BACKEND": f"tcp://{a['routers']}:{PORTS['target_be']}",
            "SPECSPLIT_ORCHESTRATOR": f"tcp://{a['orch']}:{PORTS['orch']}",
            "SPECSPLIT_CURVE_SERVER_KEY": str(self.keys["server.pub"]),
            "SPECSPLIT_CURVE_AUTHORIZED_KEYS": str(self.keys["authorized"]),
        }
        self.fleet = Fleet.create(tmp, preset=preset, threads=threads, **addrs, **extra_env)
        self.orchestrator = addrs["SPECSPLIT_ORCHESTRATOR"]

    def _spawn(self, name: str, host: str, key: str, *args: str, **env: str):
        return self.fleet.spawn(name, *args, prefix=self.lab.exec_prefix(host),
                                env={"SPECSPLIT_CURVE_SECRET_KEY_FILE": str(self.keys[key]), **env})

    def start(self) -> NetnsFleet:
        for service in ("draft", "target"):
            self._spawn(f"router_{service}", "routers", "server", "router", service)
        self._spawn("draft0", "draft", "draft", "draft", SPECSPLIT_WORKER_ID="draft-0")
        target_env = {"SPECSPLIT_WORKER_ID": "target-0"}
        if self.relay:
            self._start_relay()
            target_env["SPECSPLIT_TARGET_BACKEND"] = f"tcp://127.0.0.1:{PORTS['target_relay']}"
        self._spawn("target0", "target", "target", "target", **target_env)
        self._spawn("orchestrator", "orch", "server", "orchestrator")
        return self

    def _start_relay(self) -> None:
        upstream = f"{self.lab.addr['routers']}:{PORTS['target_be']}"
        log = open(self.tmp / "delayrelay.log", "ab")
        self._relay = subprocess.Popen(
            [*self.lab.exec_prefix("target"), sys.executable, "-m", "specsplit.delayrelay",
             "--listen", f"127.0.0.1:{PORTS['target_relay']}", "--to", upstream],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=self.fleet.env, start_new_session=True)
        log.close()
        self.fleet.procs["delayrelay"] = self._relay  # stopped with the fleet
        deadline = time.monotonic() + 30
        while "listening=" not in (self.tmp / "delayrelay.log").read_text(errors="replace"):
            if self._relay.poll() is not None or time.monotonic() > deadline:
                raise NetnsError("delayrelay did not start: " + (self.tmp / "delayrelay.log").read_text()[-2000:])
            time.sleep(0.05)

    def set_target_delay(self, delay_ms: float) -> None:
        """Delay everything the target host sends by ``delay_ms`` (0: none): the relay's delay,
        or a netem qdisc on its link."""
        if self._relay is None:
            self.lab.netem("target", delay_ms)
            return
        log, want = self.tmp / "delayrelay.log", f"delayrelay delay_ms={delay_ms:g}\n"
        before = log.read_text(errors="replace").count(want)
        self._relay.stdin.write(f"{delay_ms}\n".encode())
        self._relay.stdin.flush()
        deadline = time.monotonic() + 10
        while log.read_text(errors="replace").count(want) <= before:
            if time.monotonic() > deadline:
                raise NetnsError(f"delayrelay did not take delay {delay_ms} ms")
            time.sleep(0.02)

    def spawn_stranger(self) -> subprocess.Popen:
        """A draft worker whose key is not admitted (it must be refused; the fleet keeps serving)."""
        return self._spawn("stranger", "draft", "stranger", "draft", SPECSPLIT_WORKER_ID="draft-stranger")

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        self.fleet.wait_ready(1, 1, timeout_s)

    def produce(self, prompts: list[list[int]], max_new_tokens: int, timeout_s: float = 300.0) -> dict:
        """Run ``prompts`` concurrently from the client namespace; the producer's JSON result."""
        job = self.tmp / f"prompts-{uuid.uuid4().hex[:6]}.json"
        job.write_text(json.dumps(prompts))
        cmd = [*self.lab.exec_prefix("client"), sys.executable, "-m", "specsplit.netns", "produce",
               "--addr", self.orchestrator, "--prompts", str(job), "--max-new-tokens", str(max_new_tokens),
               "--timeout-s", str(timeout_s)]
        env = {**self.fleet.env, "SPECSPLIT_CURVE_SECRET_KEY_FILE": str(self.keys["client"])}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
        if out.returncode != 0:
            raise RuntimeError(f"producer exited {out.returncode}:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> dict[str, int]:
        return self.fleet.stop()


async def _produce(addr: str, prompts: list[list[int]], max_new_tokens: int, timeout_s: float) -> dict:
    from specsplit.client import SpecSplitClient
    from specsplit.config import ProducerSettings

    curve = ProducerSettings().curve_keys(client=True)
    async with SpecSplitClient(addr, timeout_s=timeout_s, curve=curve) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client.generate(p, max_new_tokens=max_new_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(len(r.token_ids) for r in results),
            "results": [{"token_ids": r.token_ids, "finish_reason": r.finish_reason, "rounds": r.rounds,
                         "elapsed_s": r.elapsed_s} for r in results]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specsplit.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    prod = sub.add_parser("produce", help="run prompts (a JSON list of token-id lists); print one JSON line")
    prod.add_argument("--addr", required=True)
    prod.add_argument("--prompts", required=True)
    prod.add_argument("--max-new-tokens", type=int, default=32)
    prod.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text())
    print(json.dumps(asyncio.run(_produce(args.addr, prompts, args.max_new_tokens, args.timeout_s))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
