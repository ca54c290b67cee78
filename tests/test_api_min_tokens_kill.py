"""``min_tokens`` with ``stop_token_ids`` through the HTTP API while the process serving the
answer is killed -9 (``honcho start`` of the repository's Procfile and .env, tiny fp32 pair). A
module of its own, with its own fleet: an orchestrator killed leaves its sessions on the targets
until they expire, and the kill tests wait for none to be left."""

from __future__ import annotations

import pytest
import torch

from tests.api_fleet import api_fleet, expected, tiny_pair

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    yield from api_fleet(tmp_path_factory)


@pytest.mark.parametrize("role", ["target", "orchestrator"])
def test_min_tokens_survives_a_kill(fleet, tiny, role):
    """``min_tokens`` with a ``stop_token_ids`` token, streamed while a process serving it is
    killed -9: the target's successor gets the masks with every round; the orchestrator's
    successor resumes with what remains of the minimum. The minimum is chosen so that the model
    would pick the stop token right at it: the answer is greedy decoding with the stop tokens
    masked that long, then the stop token, and a minimum off by any number of tokens would
    give another answer."""
    from tests.api_fleet import stream_killing
    from tests.test_min_tokens import masked_greedy

    model, tok, _ = tiny
    prompt, ends = [5, 17, 99, 3, 250], set(tok.stop_token_ids)
    plain = expected(model, tok, prompt, 60)
    stop = next(t for t in plain[5:] if t < tok.vocab_size)
    masked = masked_greedy(model, prompt, 320, {stop, *ends}, 320)  # the stop tokens masked throughout
    with torch.no_grad():
        rows = model(torch.tensor([prompt + masked])).logits[0, len(prompt) - 1:-1].float()
    m = next(j for j in range(150, 320) if int(rows[j].argmax()) == stop)  # where the model would stop
    want = masked[:m] + [stop]
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "min_tokens": m, "stop_token_ids": [stop]}
    choices = stream_killing(fleet, body, role)
    assert "".join(c["text"] for c in choices) == tok.decode(want)
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
