"""Fill in the middle (``suffix`` on ``/v1/completions``), as an editor's completion plugin sends
it: ``honcho start`` of the Procfile and .env with the tiny pair given Qwen2.5-Coder's FIM tokens
(copies of its model directories, ``SPECSPLIT_DRAFT_MODEL`` / ``SPECSPLIT_TARGET_MODEL``), the
official ``openai`` client. Each answer, whole and streamed, for a text and a token-id prompt, is
greedy decoding of the target on the model's FIM prompt (prefix, suffix, middle tokens around
the two texts); ``suffix: ""`` is a plain completion; ``echo`` with a suffix, and a suffix to a
model without FIM tokens (tests/test_api.py), are a 400 naming ``suffix``.

The same fleet serves llama-server's ``/infill`` (the tokenizer also has Qwen2.5-Coder's
repository tokens) and ``/completion``, as llama.vim sends them (curl) and llama.vscode."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.api_fleet import api_error, api_fleet, expected, openai_client, post_json

pytestmark = [pytest.mark.system, pytest.mark.slow]
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
REPO = ["<|repo_name|>", "<|file_sep|>"]  # a repository's files before the FIM prompt (llama-server's /infill)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny pair's directories with the three FIM tokens and the two repository tokens added
    to their tokenizer (ids past its 419 words, inside the models' 448 embedding rows)."""
    from transformers import AutoTokenizer

    from specsplit.models import ModelSettings, resolve_model_paths

    paths = resolve_model_paths(ModelSettings(preset="tiny"))
    out = {}
    for role in ("draft", "target"):
        src, dst = getattr(paths, role), tmp_path_factory.mktemp(role)
        shutil.copytree(src, dst, dirs_exist_ok=True)
        tok = AutoTokenizer.from_pretrained(src)
        assert tok.add_special_tokens({"additional_special_tokens": FIM + REPO}) == 5
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


# ---- llama-server's /infill and /completion (specsplit.api.llama_server), as editors' plugins call them
def infill_prompt(tok, prefix: str, suffix: str, prompt: str, extra: list[tuple[str, str]]) -> list[int]:
    """llama-server's layout, written out: the repository's files, then the FIM prompt."""
    pre, suf, mid, repo, sep = (tok.tok.convert_tokens_to_ids(t) for t in FIM + REPO)
    plain = tok.encode_plain
    ids = [repo, *plain("myproject\n")]
    for name, text in extra:
        ids += [sep, *plain(name + "\n"), *plain(text)]
    ids += [sep, *plain("filename\n")]
    return ids + [pre, *plain(prefix), *tok.encode_text(prompt), suf, *plain(suffix), mid]


def curl_json(fleet, path: str, body: dict) -> dict | list:
    """A POST as llama.vim sends it (curl)."""
    import subprocess

    out = subprocess.run(["curl", "-sS", "--max-time", "60", "-X", "POST", f"{fleet['url']}{path}", "-H",
                          "Content-Type: application/json", "--data-binary", "@-"], input=json.dumps(body),
                         capture_output=True, text=True, timeout=90, check=True)
    return json.loads(out.stdout)


VIM_FIELDS = ["content", "timings/prompt_n", "timings/predicted_n", "timings/predicted_ms", "truncated",
              "tokens_cached"]


def test_infill_lays_out_the_repository_and_answers_as_the_targets_greedy_decoding(fleet, served):
    """llama.vim's request (its chain: top-k, top-p, infill; here top-k 1, so the oracle is
    greedy) through curl: the answer is the target's greedy decoding of llama-server's prompt,
    ``response_fields`` pick the fields; streamed, the chunks make the same text, the last one
    has the fields picked, and no ``[DONE]`` follows."""
    tok, model = served
    prefix, suffix, middle = "class A:\n    def f(self):\n        ", "\n    return total\n", "x"
    extra = [("util.py", "def helper():\n    return 1\n"), ("b.py", "import os\n")]
    ids = infill_prompt(tok, prefix, suffix, middle, extra)
    want = until_end(expected(model, tok, ids, 24), tok.eog_token_ids)
    body = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "prompt": middle,
            "input_extra": [{"filename": f, "text": t} for f, t in extra], "n_predict": 24, "top_k": 1,
            "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 60_000, "response_fields": VIM_FIELDS}
    res = curl_json(fleet, "/infill", body)
    assert set(res) == set(VIM_FIELDS) and res["content"] == tok.decode(want), res
    assert res["timings/predicted_n"] == len(want) and res["tokens_cached"] == len(ids) + len(want)
    whole = post_json(fleet, "/infill", {**body, "response_fields": None, "return_tokens": True}).json()
    assert whole["tokens"] == want and whole["tokens_evaluated"] == len(ids) and whole["stop"] is True
    assert whole["prompt"] == tok.tok.decode(ids, skip_special_tokens=False)
    assert whole["stop_type"] == ("eos" if want[-1] in tok.eog_token_ids else "limit")
    assert whole["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    with httpx.stream("POST", f"{fleet['url']}/infill", json={**body, "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines]
    assert all(ln.startswith("data: {") for ln in lines)  # (no [DONE])
    assert "".join(e["content"] for e in events) == tok.decode(want)
    assert all(e["stop"] is False for e in events[:-1]) and set(events[-1]) == set(VIM_FIELDS)  # (filtered)
    assert events[-1]["content"] == ""  # (the text went in the chunks before)


def until_end(ids: list[int], ends) -> list[int]:
    """``ids`` up to llama.cpp's first end of generation (included), where llama-server stops."""
    at = next((i for i, t in enumerate(ids) if t in ends), None)
    return ids if at is None else ids[:at + 1]


def test_infill_sampler_chooses_every_token(fleet, served, dirs):
    """llama.vim's chain as it sends it (top-k 40, top-p 0.99, infill; no temperature): sampled,
    every token of every answer is one llama.cpp's infill sampler leaves at its place in the
    target's distribution (its EOT where it leaves nothing), and the sampler did choose: some
    places leave several tokens, some one of fewer than the candidates."""
    import torch

    from schemas import SamplingSpec
    from specsplit.engine import sampling as S
    from specsplit.engine.infill import InfillVocab

    tok, model = served
    vocab = InfillVocab.for_tokenizer(tok.tok, dirs["target"], model.config.vocab_size)
    spec = SamplingSpec(temperature=1.0, top_k=40, top_p=0.99)
    checked, several, cut = 0, 0, 0
    for n, (prefix, suffix) in enumerate([("def f(x):\n    ", "\n"), ("import os\nclass B:\n    ", "\n    pass\n"),
                                          ("x = [1, 2", "]\n"), ("for i in range(10):\n", "print(i)\n")]):
        ids = infill_prompt(tok, prefix, suffix, "", [])
        for seed in range(4):
            body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 12, "top_k": 40, "top_p": 0.99,
                    "samplers": ["top_k", "top_p", "infill"], "seed": 100 * n + seed, "return_tokens": True}
            res = post_json(fleet, "/infill", body).json()
            assert res["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"], res
            ctx = list(ids)
            for t in res["tokens"]:
                with torch.no_grad():
                    logits = model(torch.tensor([ctx])).logits[0, -1:]
                probs, cand = S.top_k_rows(logits, 40, spec)
                keep, forced = vocab.keep(cand.numpy(), probs.numpy())
                left = [vocab.eot] if forced[0] else cand[0][torch.from_numpy(keep[0])].tolist()
                assert t in left, (prefix, seed, ctx[len(ids):], t, left)
                checked, several = checked + 1, several + (len(left) > 1)
                cut += not forced[0] and len(left) < int((probs[0] > 0).sum())
                ctx.append(t)
            assert res["tokens"] == until_end(res["tokens"], tok.eog_token_ids)
    assert checked >= 30 and several >= 5 and cut >= 10, (checked, several, cut)


def test_infill_n_indent_and_cache_warming(fleet, served):
    """``n_indent`` ends the answer where a later line is indented less (the text kept is the
    greedy answer cut there, ``stop_type`` limit); ``n_predict: 0`` answers nothing (llama.vim's
    cache warming); a model's FIM tokens spelled in the code are text."""
    from tests.test_api_text import indent_reference

    tok, model = served
    prefix, suffix = "class A:\n    def f(self):\n        ", "\n    return total\n"
    ids = infill_prompt(tok, prefix, suffix, "x", [])
    full = tok.decode(expected(model, tok, ids, 40))
    kept = indent_reference(full, 4)
    assert kept != full, f"the tiny target's answer has no line indented less than 4: {full!r}"
    body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": "x", "n_predict": 40, "temperature": 0,
            "n_indent": 4}
    res = post_json(fleet, "/infill", body).json()
    assert res["content"] == kept and res["stop_type"] == "limit" and res["has_new_line"] == ("\n" in kept)
    warm = post_json(fleet, "/infill", {**body, "n_predict": 0, "input_extra": [{"text": "x = 1\n"}]}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    spelled = post_json(fleet, "/infill", {**body, "input_prefix": "s = '<|fim_middle|>'\n", "n_predict": 4}).json()
    assert FIM[2] in spelled["prompt"] and spelled["tokens_evaluated"] == len(
        infill_prompt(tok, "s = '<|fim_middle|>'\n", suffix, "x", []))


def test_completion_mixed_prompts_stop_words_and_refusals(fleet, served):
    """``/completion``: a prompt of text and token ids mixed is their concatenation; a list of
    texts is several answers; a stop word ends one (``stop_type`` word, ``stopping_word``).
    What this server cannot honour is a 400 naming the field."""
    tok, model = served
    text, more = "def add(a, b):\n", tok.encode_text("    return")
    ids = tok.encode(text) + more
    want = expected(model, tok, ids, 16)
    res = post_json(fleet, "/completion", {"prompt": [text, *more], "n_predict": 16, "temperature": 0}).json()
    assert res["content"] == tok.decode(want) and res["tokens_evaluated"] == len(ids)
    both = post_json(fleet, "/completions", {"prompt": [text, "x = "], "n_predict": 8, "temperature": 0}).json()
    assert isinstance(both, list) and [r["index"] for r in both] == [0, 1]
    assert both[1]["content"] == tok.decode(expected(model, tok, tok.encode("x = "), 8))
    answer = tok.decode(want)
    word = next((answer[i:i + 2] for i in range(2, len(answer) - 2) if answer[i:i + 2].isprintable()), None)
    assert word, answer
    cut = post_json(fleet, "/completion", {"prompt": [text, *more], "n_predict": 16, "temperature": 0,
                                           "stop": [word]}).json()
    assert cut["content"] == answer[:answer.index(word)] and cut["stop_type"] == "word"
    assert cut["stopping_word"] == word
    for body, param in [({"prompt": "x", "repeat_penalty": 1.1}, "repeat_penalty"),
                        ({"prompt": "x", "mirostat": 2}, "mirostat"),
                        ({"prompt": "x", "samplers": ["min_p", "top_p"]}, "samplers"),
                        ({"prompt": "x", "samplers": ["top_q"]}, "samplers"),
                        ({"prompt": "x", "no_such_field": 1}, "no_such_field"),
                        ({"prompt": "x", "input_prefix": "a"}, "input_prefix"),
                        ({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, "grammar"),
                        ({"prompt": [10**9]}, "prompt")]:
        api_error(post_json(fleet, "/completion", body), 400, param=param)
    api_error(post_json(fleet, "/infill", {"input_prefix": "a"}), 400, param="input_suffix")
    api_error(post_json(fleet, "/infill", {"input_prefix": "a", "input_suffix": "", "prompt": [1]}), 400,
              param="prompt")


def test_infill_streams_its_answer_through_a_kill_of_its_target_worker(fleet, served):
    """kill -9 of the target worker serving a streamed /infill: the fleet resumes the session
    on the other worker, and the answer is still the target's greedy decoding of the layout."""
    from tests.api_fleet import stream_killing

    tok, model = served
    prefix, suffix, line = "def add(a, b):\n", "\n", "    "
    want = tok.decode(expected(model, tok, infill_prompt(tok, prefix, suffix, line, []), 120))
    assert len(want) > 60, want
    body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": line, "n_predict": 120, "temperature": 0,
            "stream": True}
    chunks = stream_killing(fleet, body, "target", path="/infill")
    assert "".join(c["content"] for c in chunks) == want and chunks[-1]["stop"] is True


def test_llama_vscodes_chat_edit_body_on_the_openai_endpoint(fleet, served):
    """llama.vscode's chat edit as it posts it to /v1/chat/completions (llama.cpp's fields and
    chain, ``max_tokens: -1``), here at temperature 0: the target's greedy decoding of the chat."""
    from tests.test_llama_server_api import VSCODE_EDIT

    tok, model = served
    ids = tok.encode_chat(VSCODE_EDIT["messages"])
    want = expected(model, tok, ids, 24)
    body = {**VSCODE_EDIT, "temperature": 0, "max_tokens": 24, "model": openai_client(fleet).models.list().data[0].id}
    res = post_json(fleet, "/v1/chat/completions", body)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["message"]["content"] == tok.decode(want)
    unlimited = post_json(fleet, "/v1/chat/completions", {**body, "max_tokens": -1, "stop": [tok.decode(want[:3])]})
    assert unlimited.status_code == 200 and unlimited.json()["choices"][0]["message"]["content"] == ""


def test_completion_probabilities_are_the_targets(fleet, served):
    """``n_probs`` on /completion: each answer token with its log-probability under the target
    (before sampling, llama-server's default) and the n most likely ones, whole and streamed."""
    import torch

    from tests.test_api_sampling import reference

    tok, model = served
    ids = tok.encode("def add(a, b):\n")
    out = expected(model, tok, ids, 8)
    rows = reference(model, ids, out)
    body = {"prompt": ids, "n_predict": 8, "temperature": 0, "n_probs": 3}
    res = post_json(fleet, "/completion", body).json()
    probs = res["completion_probabilities"]
    assert [p["id"] for p in probs] == out
    for p, row in zip(probs, rows):
        assert abs(p["logprob"] - float(row[p["id"]])) < 1e-4 and p["token"] == tok.token_piece(p["id"])[0]
        values = row.topk(3).values
        assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert p["top_logprobs"][0]["id"] == p["id"] and bytes(p["bytes"]) == tok.token_piece(p["id"])[1]
    with httpx.stream("POST", f"{fleet['url']}/completion", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines() if ln]
    streamed = [p for c in chunks for p in c.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == out and torch.allclose(
        torch.tensor([p["logprob"] for p in streamed]), torch.tensor([p["logprob"] for p in probs]))
    api_error(post_json(fleet, "/completion", {**body, "post_sampling_probs": True}), 400,
              param="post_sampling_probs")
