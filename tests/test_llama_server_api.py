"""llama-server's request fields as the fleet takes them (``specsplit.api.llama_server``), without
a fleet: the sampler chain and its order (llama.cpp's default chain is temperature last), the
fields taken at any value or only when off, ``logit_bias``'s forms, ``prompt``'s forms, and the
``/infill`` layout's cuts to the window and the context. The endpoints themselves run on a
fleet in tests/test_api_fim.py."""

from __future__ import annotations

import shutil

import pytest

from specsplit.api import llama_server as L
from specsplit.api.protocol import ApiError

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]


def req(**body) -> L.LlamaRequest:
    return L.parse_llama(body)


def chain(r: L.LlamaRequest):
    return L.sampling_of(r.samplers, r.temperature, r.top_k, r.top_p, r.min_p)


@pytest.mark.parametrize("body, fields, last, used", [
    ({}, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, True,
     ["top_k", "top_p", "min_p", "temperature"]),  # llama-server's defaults: the temperature last
    ({"samplers": ["top_k", "top_p", "infill"], "top_p": 0.9},  # llama.vim's chain: no temperature
     {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.0}, False, ["top_k", "top_p", "infill"]),
    ({"samplers": ["top_k", "top_p", "infill", "temperature"], "temperature": 0.5},  # the temperature after infill
     {"temperature": 0.5, "top_k": 40, "top_p": 0.95, "min_p": 0.0}, True, ["top_k", "top_p", "infill", "temperature"]),
    ({"samplers": "tkpi", "temperature": 0.5},  # before everything its scale changes
     {"temperature": 0.5, "top_k": 40, "top_p": 0.95, "min_p": 0.0}, False, ["temperature", "top_k", "top_p", "infill"]),
    ({"samplers": "tkpm", "temperature": 0.5}, {"temperature": 0.5, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
     False, ["temperature", "top_k", "top_p", "min_p"]),  # one-letter codes, the temperature first
    ({"samplers": ["Top-K", "temp", "nucleus"], "min_p": 0.2},  # aliases; min-p not in the chain
     {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.0}, False, ["top_k", "temperature", "top_p"]),
    ({"temperature": 0, "top_p": 1.0, "min_p": 0}, {"temperature": 0, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
     False, ["top_k", "temperature"]),  # greedy
    ({"samplers": ["min_p", "temperature", "top_k"], "top_k": 0}, {"temperature": 0.8, "top_k": 0, "top_p": 1.0,
                                                                  "min_p": 0.05}, True, ["min_p", "temperature"]),
])
def test_the_sampler_chain_as_the_fleet_applies_it(body, fields, last, used):
    assert chain(req(**body)) == (fields, last, used)


@pytest.mark.parametrize("body", [{"samplers": ["top_p", "top_k"]}, {"samplers": ["min_p", "top_p"]},
                                  {"samplers": ["top_p", "temperature", "min_p"]}, {"samplers": ["top_k", "top_k"]},
                                  {"samplers": ["adaptive_p"]}, {"samplers": ["mystery"]}, {"samplers": "kz"},
                                  {"samplers": ["top_k", "infill", "top_p"]},  # infill before a cut
                                  {"samplers": ["top_p", "infill"]}, {"samplers": "kpi", "top_k": 0},  # no top-k
                                  {"samplers": "kpi", "top_k": 5000},
                                  {"samplers": ["top_k", "top_p", "temperature", "infill"], "temperature": 0.5}])
def test_a_chain_the_fleet_cannot_keep_is_a_400(body):
    with pytest.raises(ApiError) as err:
        chain(req(**body))
    assert err.value.status == 400 and err.value.param == "samplers"


def test_fields_taken_at_any_value_or_only_off():
    req(id_slot=3, cache_prompt=False, t_max_prompt_ms=500, repeat_last_n=256, dry_base=1.75, model="any")
    req(repeat_penalty=1.0, typical_p=1, top_n_sigma=-1, mirostat=0, n_probs=0, lora=[])
    for name, value in [("repeat_penalty", 1.1), ("typical_p", 0.9), ("mirostat", 1), ("post_sampling_probs", True),
                        ("dry_multiplier", 0.8), ("xtc_probability", "x"), ("what", 1)]:
        with pytest.raises(ApiError) as err:
            req(**{name: value})
        assert err.value.status == 400 and err.value.param == name, name
    with pytest.raises(ApiError) as err:
        req(top_p=1.5)
    assert err.value.param == "top_p"
    assert req(max_tokens=7).budget == 7 and req().budget == -1 and req(n_predict=0, max_tokens=9).budget == 0


def test_text_that_is_not_unicode_is_a_400_naming_its_field():
    """A lone surrogate (valid JSON escapes, no text): the fuzzer's ``{"prompt": "\\ud800"}`` got a
    500 from the tokenizer's TypeError."""
    for body, param in [({"prompt": "\ud800"}, "prompt"), ({"prompt": ["x", 5, "\udfff"]}, "prompt"),
                        ({"input_extra": [{"text": "a", "filename": "\ud800"}]}, "input_extra"),
                        ({"logit_bias": [["\ud800", 1]]}, "logit_bias"), ({"\ud800": 1}, None)]:
        with pytest.raises(ApiError) as err:
            req(**body)
        assert err.value.status == 400 and err.value.param == param, body


def test_prompt_forms():
    assert L.prompt_pieces("a") == [["a"]]
    assert L.prompt_pieces(["a", 5, "b"]) == [["a", 5, "b"]]  # ids among texts: one prompt
    assert L.prompt_pieces([1, 2]) == [[1, 2]]
    assert L.prompt_pieces(["a", "b"]) == [["a"], ["b"]]  # texts only: several
    assert L.prompt_pieces(["a", ["b", 3]]) == [["a"], ["b", 3]]
    for bad in ([], {"a": 1}, [True], [["a", 1.5]], None):
        with pytest.raises(ApiError):
            L.prompt_pieces(bad)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    src, dst = resolve_model_paths(ModelSettings(preset="tiny")).target, tmp_path_factory.mktemp("tok")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    t = AutoTokenizer.from_pretrained(src)
    t.add_special_tokens({"additional_special_tokens": FIM})
    t.save_pretrained(dst)
    return ServedTokenizer(dst)


def test_logit_bias_forms(tok):
    words = tok.encode_plain("Hello")
    assert L.logit_bias_of(req(logit_bias=[[15, 1.5], ["Hello", -2]]), tok) == {"15": 1.5, **{str(t): -2.0 for t in
                                                                                             words}}
    assert L.logit_bias_of(req(logit_bias={"15": False}), tok) == {"15": -100.0}
    assert L.logit_bias_of(req(logit_bias=[]), tok) is None
    for bad in ([[1, "x"]], [1, 2], "x", [[1.5, 1]]):
        with pytest.raises(ApiError):
            L.logit_bias_of(req(logit_bias=bad), tok)


class FakeState:
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def max_model_len(self) -> int:
        return self.limit

    def check_ids(self, ids, param="prompt"):
        return list(ids)


def test_infill_keeps_the_prefix_end_the_suffix_start_and_the_last_of_the_files(tok, monkeypatch):
    """With a window of 16 tokens: the prefix's last 12, the suffix's first 4 - 2 - the prompt's;
    the files' last tokens that leave the answer its n_predict in the context."""
    monkeypatch.setattr(L, "FIM_WINDOW", 16)
    pre, suf, mid, repo, sep = tok.ids_of(FIM)
    prefix, suffix = " ".join(["a"] * 40), " ".join(["b"] * 40)
    p, s = tok.encode_plain(prefix), tok.encode_plain(suffix)
    chunk = " ".join(["c"] * 30)
    extra = [repo, *tok.encode_plain("myproject\n"), sep, *tok.encode_plain("x.py\n"), *tok.encode_plain(chunk), sep,
             *tok.encode_plain("filename\n")]
    body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": "z", "n_predict": 10,
            "input_extra": [{"filename": "x.py", "text": chunk}]}
    fim = [pre, *p[-12:], *tok.encode_text("z"), suf, *s[:4 - 2 - 1], mid]
    assert L.infill_ids(tok, req(**body), FakeState(10_000)) == extra + fim
    assert L.infill_ids(tok, req(**body), FakeState(len(fim) + 10 + 7)) == extra[-7:] + fim
    assert L.infill_ids(tok, req(**body), FakeState(len(fim))) == fim


# llama.vscode's chat edit, sent to /v1/chat/completions with llama.cpp's fields (its own defaults)
VSCODE_EDIT = {"messages": [{"role": "system", "content": "You are an expert coder."},
                            {"role": "user", "content": "rename x to count"}],
               "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
               "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1,
               "xtc_probability": 0, "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1,
               "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
               "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1, "timings_per_token": False}


def test_openai_endpoints_take_llama_cpps_fields():
    """What llama-server's clients send to its OpenAI endpoints: llama.cpp's chain (here the
    temperature last), its fields at their off values, ``max_tokens: -1`` (no limit); a field
    that is on is a 400 naming it, an unknown one too."""
    from specsplit.api.planning import sampling_for
    from specsplit.api.protocol import ChatCompletionRequest, CompletionRequest, parse

    chat = parse(ChatCompletionRequest, {"model": "m", **VSCODE_EDIT})
    assert chat.max_tokens is None and chat.samplers == "edkypmxt"
    sp = sampling_for(chat, 7)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.temperature_last) == (0.8, 40, 0.95, 0.05, True)
    plain = sampling_for(parse(ChatCompletionRequest, {"model": "m", "messages": VSCODE_EDIT["messages"],
                                                      "temperature": 0.8, "top_p": 0.95}), 7)
    assert plain.temperature_last is None and plain.top_k == 0  # OpenAI's order without a chain
    vim = sampling_for(parse(CompletionRequest, {"model": "m", "prompt": "x", "samplers": ["top_k", "top_p"],
                                                 "top_k": 40, "top_p": 0.9, "temperature": 0.5}), 7)
    assert (vim.temperature, vim.top_k, vim.top_p, vim.temperature_last) == (1.0, 40, 0.9, None)  # (no temperature)
    assert vim.infill is None
    fim = sampling_for(parse(CompletionRequest, {"model": "m", "prompt": "x", "samplers": ["top_k", "top_p", "infill"],
                                                 "top_k": 40, "top_p": 0.99}), 7)
    assert (fim.temperature, fim.top_k, fim.infill) == (1.0, 40, True)  # llama.vscode's chain on /v1/completions
    greedy = sampling_for(parse(CompletionRequest, {"model": "m", "prompt": "x", "samplers": "kpi", "top_k": 1}), 7)
    assert greedy.greedy and greedy.infill is None
    for name, value in [("typical_p", 0.9), ("repeat_penalty", 1.1), ("mirostat", 2), ("samplers", ["top_p", "top_k"]),
                        ("n_probs", 3), ("frobnicate", 1)]:
        with pytest.raises(ApiError) as err:
            sampling_for(parse(ChatCompletionRequest, {"model": "m", **VSCODE_EDIT, name: value}), 7)
        assert err.value.status == 400 and err.value.param == name, name
