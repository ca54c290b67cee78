"""Fill in the middle (``suffix`` on ``/v1/completions``), as an editor's completion plugin sends
it: ``honcho start`` of the Procfile and .env with the tiny pair given Qwen2.5-Coder's FIM tokens
(copies of its model directories, ``SPECSPLIT_DRAFT_MODEL`` / ``SPECSPLIT_TARGET_MODEL``), the
official ``openai`` client. Each answer, whole and streamed, for a text and a token-id prompt, is
greedy decoding of the target on the model's FIM prompt (prefix, suffix, middle tokens around
the two texts); ``suffix: ""`` is a plain completion; ``echo`` with a suffix, and a suffix to a
model without FIM tokens (tests/test_api.py), are a 400 naming ``suffix``."""

from __future__ import annotations

import shutil

import pytest

from tests.api_fleet import api_error, api_fleet, expected, openai_client, post_json

pytestmark = [pytest.mark.system, pytest.mark.slow]
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny pair's directories with the three FIM tokens added to their tokenizer (ids past
    its 419 words, inside the models' 448 embedding rows)."""
    from transformers import AutoTokenizer

    from specsplit.models import ModelSettings, resolve_model_paths

    paths = resolve_model_paths(ModelSettings(preset="tiny"))
    out = {}
    for role in ("draft", "target"):
        src, dst = getattr(paths, role), tmp_path_factory.mktemp(role)
        shutil.copytree(src, dst, dirs_exist_ok=True)
        tok = AutoTokenizer.from_pretrained(src)
        assert tok.add_special_tokens({"additional_special_tokens": FIM}) == 3
        tok.save_pretrained(dst)
        out[role] = dst
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, dirs):
    yield from api_fleet(tmp_path_factory, SPECSPLIT_DRAFT_MODEL=str(dirs["draft"]),
                         SPECSPLIT_TARGET_MODEL=str(dirs["target"]), SPECSPLIT_DRAFT_DTYPE="float32",
                         SPECSPLIT_TARGET_DTYPE="float32")


@pytest.fixture(scope="module")
def served(dirs):
    from transformers import AutoModelForCausalLM

    from specsplit.api.tokenizer import ServedTokenizer

    return ServedTokenizer(dirs["target"]), AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()


def test_the_answer_fills_the_gap_as_the_targets_greedy_decoding(fleet, served):
    tok, model = served
    assert tok.fim == tuple(FIM)
    pre, suf, mid = (tok.tok.convert_tokens_to_ids(t) for t in FIM)
    client = openai_client(fleet)
    model_id = client.models.list().data[0].id
    before, after = "def add(a, b):\n    ", "\n    return total\n"
    ids = tok.encode(before)
    for prompt in (before, ids):
        fim = [pre, *ids, suf, *tok.encode_text(after), mid]
        want = expected(model, tok, fim, 24)
        text = tok.decode(want)
        res = client.completions.create(model=model_id, prompt=prompt, suffix=after, max_tokens=24, temperature=0)
        assert res.choices[0].text == text and res.usage.completion_tokens == len(want)
        assert res.usage.prompt_tokens == len(fim)
        stream = client.completions.create(model=model_id, prompt=prompt, suffix=after, max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    plain = client.completions.create(model=model_id, prompt=before, suffix="", max_tokens=12, temperature=0)
    assert plain.choices[0].text == tok.decode(expected(model, tok, ids, 12))
    api_error(post_json(fleet, "/v1/completions", {"model": model_id, "prompt": before, "suffix": after,
                                                   "echo": True}), 400, param="suffix")
