"""A fleet as people start it, for the benches: ``honcho start`` of the repository's Procfile
(every line, the HTTP API's included) with its .env under the shell's settings (as
``specsplit.bench.fleetenv`` reads them), on free ports; its processes found through /proc (the
supervised child doing a role's work, never its supervisor), and stopped by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLOT = "orchestrator.1"  # honcho's name for the Procfile's orchestrator line
CHILD_MARKER = b"SPECSPLIT_SUPERVISED_CHILD=1"


def _procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, start time, state) of every process readable here."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = (int(f[1]), f[19], f[0])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _alive(snapshot: dict[int, str]) -> list[int]:
    """The pids of ``snapshot`` (pid -> start time) still running as the same process."""
    table = _procs()
    return [p for p, start in snapshot.items() if p in table and table[p][1] == start and table[p][2] != "Z"]


class HonchoFleet:
    """``honcho start`` of the repository's Procfile with its .env (the shell's settings win, as
    in ``specsplit.bench.fleetenv``), its addresses and API port on free ports."""

    def __init__(self, tmp: Path, preset: str, defaults: dict[str, str], concurrency: str | None = None,
                 **settings: str) -> None:
        from specsplit.bench.fleetenv import fleet_env
        from specsplit.launch import free_ports

        names = ("draft_router", "draft_backend", "target_router", "target_backend", "orchestrator")
        *ports, api_port = free_ports(len(names) + 1)
        addrs = {f"SPECSPLIT_{n.upper()}": f"tcp://127.0.0.1:{p}" for n, p in zip(names, ports)}
        self.tmp, self.proc, self.concurrency = tmp, None, concurrency  # honcho's -c ("target=2"), or None
        self.beside_procs: list[subprocess.Popen] = []  # ``beside``'s, stopped first
        self.orchestrator, self.api_url = addrs["SPECSPLIT_ORCHESTRATOR"], f"http://127.0.0.1:{api_port}"
        self.settings = {**fleet_env(defaults), **addrs, "SPECSPLIT_PRESET": preset, "SPECSPLIT_ORCHESTRATOR_COUNT": "1",
                         "SPECSPLIT_API_HOST": "127.0.0.1", "SPECSPLIT_API_PORT": str(api_port),
                         "SPECSPLIT_METRICS_PORT": "0",  # no fleet-wide metrics ports: other fleets may run here
                         "SPECSPLIT_FLEET_SECRET_FILE": os.environ.get("SPECSPLIT_FLEET_SECRET_FILE")
                         or str(tmp / "fleet.secret"), **settings}

    def start(self) -> HonchoFleet:
        from specsplit.launch import _die_with_parent

        if not (REPO / "Procfile").is_file():
            raise SystemExit(f"specsplit bench: no Procfile in {REPO} (run it from a checkout of the repository)")
        (self.tmp / "fleet.env").write_text("".join(f"{k}={v}\n" for k, v in self.settings.items()))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
        with open(self.tmp / "honcho.log", "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "honcho", "start", "-f", str(REPO / "Procfile"), "-e", str(self.tmp / "fleet.env"),
                 "-d", str(REPO), *(["-c", self.concurrency] if self.concurrency else [])], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent)
        return self

    def check(self) -> None:
        """RuntimeError with the end of the fleet's log once honcho has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            tail = (self.tmp / "honcho.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the fleet stopped (honcho exit {self.proc.returncode}):\n{tail}")

    def descendants(self) -> dict[int, str]:
        """pid -> start time of every live process under honcho."""
        table, out, todo = _procs(), {}, [self.proc.pid]
        while todo:
            parent = todo.pop()
            for pid, (ppid, start, state) in table.items():
                if ppid == parent and pid not in out and state != "Z":
                    out[pid] = start
                    todo.append(pid)
        return out

    def child(self, slot: str = SLOT) -> int | None:
        """The supervised child doing the work of honcho's ``slot`` (not its supervisor)."""
        want = f"HONCHO_PROCESS_NAME={slot}".encode()
        for pid in self.descendants():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if CHILD_MARKER in env and want in env:
                return pid
        return None

    async def restart(self, timeout_s: float, slot: str = SLOT) -> None:
        """Kill ``slot``'s supervised child (its supervisor restarts it: nothing it held carries
        over); returns once the new child runs."""
        old = self.child(slot)
        if old is None:
            raise RuntimeError(f"no supervised {slot} under honcho")
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while self.child(slot) in (None, old):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{slot} did not come back within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    def beside(self, role: str, name: str, **overrides: str) -> subprocess.Popen:
        """``specsplit ROLE`` outside honcho, on the fleet's settings with ``overrides`` (a second
        orchestrator or API that differs in a setting, for an A/B on the same workers); its log
        is ``NAME.log`` beside honcho's. Stopped by ``stop``."""
        from specsplit.launch import _die_with_parent

        env_file = self.tmp / f"{name}.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in {**self.settings, **overrides}.items()))
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "specsplit", role], cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
                                    env={**os.environ, "SPECSPLIT_ENV_FILE": str(env_file), "PYTHONPATH": str(REPO)})
        self.beside_procs.append(proc)
        return proc

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM what runs ``beside`` and honcho (it stops every process), bounded; then SIGKILL,
        by pid, whatever of its processes is still there (honcho starts each in its own session)."""
        for proc in self.beside_procs:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.proc is None:
            return None
        left = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _alive(left):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode
