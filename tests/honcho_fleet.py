"""A fleet as people start it: ``honcho start`` of the repository's Procfile and .env (tiny fp32
pair, free ports), and the /proc helpers that find the process doing a role's work (the supervised
child, never the supervisor or a shell)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from brokers.metrics import ROLE_OFFSETS, ROLE_SLOTS
from specsplit.launch import free_ports, port_is_free

REPO = Path(__file__).resolve().parents[1]
CHILD_MARKER = b"SPECSPLIT_SUPERVISED_CHILD=1"


def procs() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (ppid, cmdline, environ) of every process we can read."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            env = (d / "environ").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        out[int(d.name)] = (ppid, cmd, env)
    return out


def descendants(root: int) -> dict[int, tuple[int, str, bytes]]:
    table, out, todo = procs(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, info in table.items():
            if info[0] == parent and pid not in out:
                out[pid] = info
                todo.append(pid)
    return out


def worker_pid(root: int, slot: str) -> int:
    """The supervised child doing the work of honcho slot ``slot`` ("target.1", ...)."""
    for pid, (ppid, cmd, env) in descendants(root).items():
        if CHILD_MARKER in env.split(b"\0") and f"HONCHO_PROCESS_NAME={slot}".encode() in env.split(b"\0"):
            assert "-m specsplit" in cmd, cmd
            return pid
    raise LookupError(f"no supervised child for {slot}")


def two_free_ports(avoid: set[int] | frozenset[int] = frozenset()) -> int:
    for _ in range(50):
        p = free_ports(1, avoid=avoid)[0]
        if p < 65535 and p + 1 not in avoid and port_is_free(p + 1):
            return p
    raise RuntimeError("no two consecutive free ports")


def honcho_fleet(tmp: Path, concurrency: str = "draft=2,target=2,orchestrator=2", procfile: str = "Procfile",
                  **settings: str) -> tuple[subprocess.Popen, dict[str, int], dict]:
    """``honcho start`` of the repository's ``procfile`` and .env (tiny fp32 pair, free ports),
    with ``concurrency`` as honcho's -c and ``settings`` (SPECSPLIT_*) over the .env's."""
    # every port drawn apart from the others, and from the metrics ports of SPECSPLIT_METRICS_PORT's
    # range (its roles bind base + offset + instance - 1): none is bound before the fleet starts
    base = int(settings.get("SPECSPLIT_METRICS_PORT") or 0)
    avoid = set(range(base, base + max(ROLE_OFFSETS.values()) + ROLE_SLOTS)) if base else set()
    names = ["draft_fe", "draft_be", "target_fe", "target_be", "api"]
    ports = dict(zip(names, free_ports(len(names), avoid=avoid)))
    ports["orch"] = two_free_ports(avoid | set(ports.values()))
    ports["orch2"] = ports["orch"] + 1
    addr = {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}
    overrides = {
        "SPECSPLIT_PRESET": "tiny", "SPECSPLIT_THREADS": "1", "SPECSPLIT_PREFILL_THREADS": "1",
        # fp32 both: the exactness oracle (the .env's int8 kernels are their own reference)
        "SPECSPLIT_DRAFT_QUANTIZE": "none", "SPECSPLIT_TARGET_QUANTIZE": "none", "SPECSPLIT_DRAFT_ROUTER": addr["draft_fe"],
        "SPECSPLIT_DRAFT_BACKEND": addr["draft_be"], "SPECSPLIT_TARGET_ROUTER": addr["target_fe"],
        "SPECSPLIT_TARGET_BACKEND": addr["target_be"], "SPECSPLIT_ORCHESTRATOR": addr["orch"],
        "SPECSPLIT_ORCHESTRATOR_COUNT": "2", "SPECSPLIT_SUPERVISE_BACKOFF_S": "0.2",
        "SPECSPLIT_API_PORT": str(ports["api"]), **settings,
    }
    lines = [ln for ln in (REPO / ".env").read_text().splitlines()
             if not ln.strip().startswith("#") and "=" in ln and ln.split("=", 1)[0].strip() not in overrides]
    (tmp / "fleet.env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items())]) + "\n")
    (tmp / "Procfile").write_text((REPO / procfile).read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}".rstrip(":")
    log = open(tmp / "honcho.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "honcho", "start", "-f", str(tmp / "Procfile"), "-e", str(tmp / "fleet.env"),
         "-d", str(REPO), "-c", concurrency],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    produce_env = {**env, **overrides}
    return proc, ports, produce_env


def honcho_log(tmp: Path) -> str:
    return (tmp / "honcho.log").read_text(errors="replace")


def stop_honcho(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
