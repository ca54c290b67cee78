"""The test/bench launcher: a fleet dies with the process that launched it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import wait_until

LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from specsplit.launch import Fleet
    fleet = Fleet.create(Path(sys.argv[1]))
    proc = fleet.spawn("router_draft", "router", "draft", "--frontend", fleet.addr("draft_fe"),
                       "--backend", fleet.addr("draft_be"))
    fleet.wait_log("router_draft", "router_started", timeout_s=60)
    print(proc.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux-only")
def test_a_killed_launcher_takes_its_fleet_with_it(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        line = launcher.stdout.readline()
        assert line.strip().isdigit(), f"launcher printed {line!r}"
        child = int(line)
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)  # as the OOM killer would: no cleanup code runs
        launcher.wait(timeout=10)
        wait_until(lambda: not _alive(child), timeout_s=20, what="the router to exit after its launcher died")
    finally:
        launcher.kill()
        launcher.wait(timeout=10)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """A fleet's ports come from below the kernel's ephemeral range, where no outgoing connection
    takes them between the draw and the roles' binds."""
    import socket

    from specsplit.launch import PORT_FLOOR, ephemeral_low, free_ports

    for _ in range(5):
        ports = free_ports(12)
        assert len(set(ports)) == 12
        if ephemeral_low() - 1000 > PORT_FLOOR:
            assert all(PORT_FLOOR <= p < ephemeral_low() for p in ports), ports
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    # ports handed out already (still unbound) are not drawn again, by this process's later calls
    # too, nor a range set aside
    from specsplit.launch import handed_out, reserve

    first = free_ports(3)
    assert all(handed_out(p) for p in first) and set(first).isdisjoint(free_ports(50))
    reserve(range(first[0] + 1, first[0] + 4))
    assert handed_out(first[0] + 2)
    if ephemeral_low() - 1000 > PORT_FLOOR:
        avoid = set(range(PORT_FLOOR, ephemeral_low() - 3))
        assert set(free_ports(2, avoid=avoid)).isdisjoint(avoid)
