"""``specsplit bench gpu`` on CPU with the tiny preset and a small grid: the JSON's fields, a
floor consistent with its bytes and bandwidth, ratios, random weights from a config directory,
a budget that skips cells, and a ``--help`` that loads nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specsplit.bench import gpu

SMALL = ["--preset", "tiny", "--device", "cpu", "--tokens", "1,4", "--batch", "1,2", "--repeats", "1",
         "--context", "24", "--copy-mib", "8"]


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    with pytest.MonkeyPatch.context() as mp:  # main() sets OpenMP's environment as a worker's
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            mp.delenv(name, raising=False)
        assert gpu.main([*SMALL, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def both_roles(tmp_path_factory):
    return run(tmp_path_factory.mktemp("gpu"))


def test_help_loads_neither_torch_nor_a_model():
    code = ("import sys\nfrom specsplit.cli import main\n"
            "try:\n    main(['bench', 'gpu', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "--max-seconds" in out.stdout and out.stdout.strip().endswith("[]")


def test_cpu_grid_writes_every_cell_and_the_checks(both_roles):
    data = both_roles
    assert data["complete"] and data["config"]["preset"] == "tiny" and data["device"]["name"]
    for role in ("target", "draft"):
        m = data["models"][role]
        assert m["weights"] == "real" and m["capture_ms"] is None and "eager" in m["capture_note"]
        assert m["prefill_ms"] > 0 and m["batched_forward"]
        cells = {(c["tokens"], c["batch"]): c for c in data["grid"][role]}
        assert set(cells) == {(n, b) for n in (1, 4) for b in (1, 2)}
        for c in cells.values():
            assert c["status"] == "done" and c["ms"] > 0 and c["forwards"] >= 1
            assert c["ratio"] == pytest.approx(c["ms"] / (m["floor_ms"] * c["forwards"]), rel=0.02)
    target = {(c["tokens"], c["batch"]): c for c in data["grid"]["target"]}
    assert all(c["forwards"] == 1 for c in target.values())  # a batch of sessions: one forward
    assert target[(4, 2)]["tokens_per_forward"] == 8
    assert [c["check"] for c in data["checks"]] == [name for name, *_ in gpu.CHECKS]
    first = data["checks"][0]
    assert first["value"] == target[(1, 1)]["ratio"] and first["result"] in ("PASS", "FAIL")
    assert [c["result"] for c in data["checks"][1:]] == ["SKIP", "SKIP"]  # no 16-node or 16-session cell


def test_floor_is_the_weight_bytes_over_the_measured_bandwidth(both_roles):
    for m in both_roles["models"].values():
        bw = m["bandwidth"]
        assert bw["gb_s"] >= bw["median_gb_s"] > 0 and bw["copy_bytes"] == 8 << 20
        assert 0 < m["floor_bytes"] <= m["param_bytes"]
        assert m["floor_ms"] == pytest.approx(m["floor_bytes"] / (bw["gb_s"] * 1e9) * 1e3, rel=1e-3, abs=1e-4)


def test_a_config_dir_gives_random_weights(tmp_path, both_roles):
    source = both_roles["models"]["target"]["source"]  # the tiny target's directory: its config.json
    data = run(tmp_path, "--roles", "target", "--target-config", source, "--random-weights")
    assert data["models"]["target"]["weights"] == "random" and data["models"]["target"]["source"] == source
    assert set(data["grid"]) == {"target"} and data["complete"]


def test_the_budget_skips_what_it_cannot_reach(tmp_path):
    data = run(tmp_path, "--max-seconds", "0")
    assert not data["complete"] and data["models"] == {}
    assert {c["status"] for cells in data["grid"].values() for c in cells} == {"skipped"}
    assert {c["result"] for c in data["checks"]} == {"SKIP"}


def test_weight_bytes_count_what_a_forward_reads():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def model(tied: bool):
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=100, tie_word_embeddings=tied)
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16)

    untied, tied = model(False), model(True)
    table = 100 * 32 * 2  # the embedding's bytes in bf16
    total, read = gpu.weight_bytes(untied)
    assert total == sum(p.numel() * 2 for p in untied.parameters()) and read == total - table
    total, read = gpu.weight_bytes(tied)
    assert read == total  # the tied head reads the table once
    linear = sum(m.weight.numel() for m in tied.modules() if isinstance(m, torch.nn.Linear))
    other = sum(p.numel() for p in tied.parameters()) - linear  # norms and biases (the table is the head's)
    assert gpu.weight_bytes(tied, int8=True)[1] == linear + 4 * other


def test_target_trees_are_chains_of_at_most_six_nodes():
    assert gpu.chain_parents(1) == [-1] and gpu.chain_parents(5) == [-1, 0, 1, 2, 3]
    assert gpu.chain_parents(9) == [-1, 0, 0, 1, 2, 3, 4, 5, 6]
    for n in (2, 7, 16, 64):
        parents, depth = gpu.chain_parents(n), [0] * n
        for i in range(1, n):
            assert 0 <= parents[i] < i
            depth[i] = depth[parents[i]] + 1
        assert max(depth) <= gpu.CHAIN_DEPTH


def test_checks_pass_fail_and_skip():
    grid = [{"tokens": 1, "batch": 1, "status": "done", "ms": 10.0, "ratio": 1.5},
            {"tokens": 16, "batch": 1, "status": "done", "ms": 14.0, "ratio": 2.1},
            {"tokens": 4, "batch": 1, "status": "done", "ms": 11.0, "ratio": 1.6},
            {"tokens": 4, "batch": 16, "status": "skipped"}]
    rows = gpu.checks(grid)
    assert [(r["value"], r["result"]) for r in rows] == [(1.5, "PASS"), (1.4, "FAIL"), (None, "SKIP")]
