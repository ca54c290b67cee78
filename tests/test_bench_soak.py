"""``specsplit bench soak`` on the tiny models: sessions through a real fleet with many in
flight; none lost, the same prompt always gets the same answer, and the RSS of each worker and
the orchestrator stays within 5% once warm (issue 15; the full check is 1,000 sessions, 256 at a
time: ``specsplit bench soak --sessions 1000 --concurrency 256``)."""

from __future__ import annotations

import json
import os

import pytest

from specsplit.bench import soak

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_soak_reduced_rss_flat_and_nothing_lost(tmp_path, capsys, monkeypatch):
    out = tmp_path / "soak.json"
    # no heap trim within this 8-second run: one that lands just before session 200 measures the
    # target below its working set (once 568 -> 540 MiB, back to 569 by session 400: "+5.3 %"
    # with nothing held); the 1,000-session soaks in ops/results run with the trims
    monkeypatch.setenv("SPECSPLIT_TRIM_EVERY_S", "3600")
    # warm at session 200, as the issue measures it. The int8 target creates its oneDNN GEMM
    # primitives as it loads (CpuBackend.warm); before that it met rarer batch sizes all run long
    # (2-core Xeon: target RSS +2.8 % from session 200 to 500, +0.26 % since; the real pair: see
    # ops/results/soak-qwen-coder-1000x256-heap-trim-*)
    rc = soak.main(["--sessions", "500", "--concurrency", "64", "--rss-from", "200", "--sample-every", "100",
                    "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["completed"] == 500 and data["lost"] == 0 and data["diverged"] == 0, data["lost_examples"]
    assert data["rss_flat"], data["rss_ratio"]  # the bound is the issue's; never loosened here
    assert rc == 0 and data["ok"]
    assert [s["sessions"] for s in data["samples"]] == [100, 200, 300, 400, 500]
    assert set(soak.CHECKED) <= set(data["rss_ratio"]) and all(r > 0 for r in data["rss_ratio"].values())
    # nothing in flight: every per-session table is empty again, once the last EndSession landed
    # (what the soak's last scrape read, not how long it took: settled_s is the box's speed)
    end = data["samples"][-1]["gauges"]
    assert not soak.busy(end), end
    assert end["draft0"]['specsplit:worker_sessions{service="draft"}'] == 0
    assert end["target0"]['specsplit:worker_kv_bytes{service="target"}'] == 0
    assert end["orchestrator"]["specsplit:num_sessions_running"] == 0
    assert "| sessions done | in flight |" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_256_concurrent_sessions_complete(tmp_path):
    out = tmp_path / "soak256.json"
    soak.main(["--sessions", "256", "--concurrency", "256", "--max-new-tokens", "8", "--rss-from", "128",
               "--sample-every", "128", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["completed"] == 256 and data["lost"] == 0 and data["diverged"] == 0, data["lost_examples"]
    assert data["max_in_flight"] == 256  # all of them in flight together


def test_a_fleet_is_busy_while_any_session_table_holds_something():
    idle = {"target0": {'specsplit:worker_sessions{service="target"}': 0.0,
                        'specsplit:worker_kv_bytes{service="target"}': 0.0},
            "orchestrator": {"specsplit:num_sessions_running": 0.0}}
    assert not soak.busy(idle)
    held = {**idle, "target0": {**idle["target0"], 'specsplit:worker_kv_bytes{service="target"}': 1638400.0}}
    assert soak.busy(held)
    assert soak.busy({**idle, "draft0": {"error": "timed out"}})


def test_rss_of_this_process_tree():
    assert soak.tree_rss(os.getpid()) > 10 * 2**20
    assert soak._proc_rss(os.getpid()) > 10 * 2**20
    assert os.getpid() in soak._proc_tree(os.getpid())
    assert soak.tree_rss(2**22 + 12345) == 0  # gone


def test_rss_check_uses_the_issue_bound():
    names = ("draft0", "target0", "orchestrator", "router_draft", "router_target")

    def sample(n, **rss):
        return {"sessions": n, "rss": {name: rss.get(name, 100) for name in names}}

    check = soak.rss_check([sample(200), sample(1000, draft0=105, orchestrator=106)], 200, 1000, 0.05)
    assert check["rss_ratio"]["draft0"] == 1.05 and not check["rss_flat"] and check["routers_flat"]
    assert soak.rss_check([sample(100, draft0=200), sample(200), sample(1000, draft0=105)], 200, 1000, 0.05)["rss_flat"]
    # grown in between, freed by the end: not flat
    spiky = soak.rss_check([sample(200), sample(600, target0=110), sample(1000)], 200, 1000, 0.05)
    assert spiky["rss_ratio"]["target0"] == 1.0 and spiky["rss_peak_ratio"]["target0"] == 1.1 and not spiky["rss_flat"]
