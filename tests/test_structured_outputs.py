"""vLLM's structured outputs (``specsplit.api.structured``): each form a request can take
(``structured_outputs`` and the ``guided_*`` fields before vLLM 0.12) becomes a grammar that
passes exactly the outputs it should (llguidance on the tiny tokenizer: a text passes when its
tokens are allowed and leave the grammar accepting), the old fields mean what the new ones do,
SGLang's ``json_schema``, ``regex`` and ``ebnf`` too, and what cannot be honoured is a 400
naming its parameter. The fleet's answers under them:
tests/test_api_structured.py."""

from __future__ import annotations

import json

import pytest

from specsplit.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from specsplit.api.structured import closed, constraint_of


@pytest.fixture(scope="module")
def passes():
    import llguidance.hf
    from llguidance import LLMatcher

    from specsplit.engine.grammar import to_grammar
    from tests.api_fleet import tiny_pair

    hf = tiny_pair()[1].tok
    lltok = llguidance.hf.from_tokenizer(hf)

    def check(body: dict, text: str) -> bool:
        _, spec = constraint_of(parse(CompletionRequest, {"model": "m", "prompt": "x", **body}))
        m = LLMatcher(lltok, to_grammar(spec))
        ids = hf.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    return check


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("body", "good", "bad"), [
    ({"structured_outputs": {"choice": ["positive", "negative"]}}, ["negative", "positive"],
     ["neutral", "positive!", "posit", ""]),
    ({"guided_choice": ["a \"quoted\" one", "é"]}, ['a "quoted" one', "é"], ["a", "e"]),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2,4}"}}, ["123-ab", "999-wxyz"], ["12-ab", "123-a", "123-abcde"]),
    ({"guided_regex": r"(yes|no)\.?"}, ["yes", "no."], ["maybe", "yes.."]),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no" " way"?'}}, ["yes", "no way"], ["yes way", "nah"]),
    ({"guided_grammar": 'start: NUM ("+" NUM)*\nNUM: /[0-9]+/'}, ["1+22+3", "7"], ["1+", "+1", "a"]),
    ({"structured_outputs": {"json": OBJ}}, ['{"a": 1}', '{ "a" : 2 }', '{"a": 1, "b": 2}'], ['{"a": "x"}', "[]"]),
    ({"structured_outputs": {"json": json.dumps(OBJ), "disable_any_whitespace": True}}, ['{"a":1}'],
     ['{"a": 1}', '{ "a":1}']),
    ({"structured_outputs": {"json": OBJ, "disable_additional_properties": True}}, ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    ({"guided_json": OBJ, "guided_whitespace_pattern": "[ ]?", "guided_decoding_backend": "xgrammar"},
     ['{"a":1}', '{ "a": 1 }'], ['{\n"a": 1}', '{"a":  1}']),
    ({"structured_outputs": {"json_object": True}}, ["{}", '{"x": [1]}'], ["[]", "1"]),
    ({"response_format": {"type": "json_object"}}, ["{}"], ["[]"]),
    ({"regex": "[xy]{2}"}, ["xy", "yy"], ["x", "xyz"]),  # SGLang's
    ({"ebnf": 'root ::= "a" "b"*'}, ["a", "abb"], ["b"]),
    ({"json_schema": json.dumps(OBJ)}, ['{"a": 3}'], ['{"b": 3}']),
])
def test_each_form_passes_exactly_what_it_asks_for(passes, body, good, bad):
    for text in good:
        assert passes(body, text), text
    for text in bad:
        assert not passes(body, text), text


def test_the_fields_before_vllm_0_12_mean_what_structured_outputs_do():
    def spec(body, cls=CompletionRequest):
        base = {"model": "m", "prompt": "x"} if cls is CompletionRequest else {
            "model": "m", "messages": [{"role": "user", "content": "hi"}]}
        return constraint_of(parse(cls, {**base, **body}))

    for old, new in ((("guided_json", OBJ), ("json", OBJ)), (("guided_regex", "a+"), ("regex", "a+")),
                     (("guided_choice", ["x", "y"]), ("choice", ["x", "y"])),
                     (("guided_grammar", 'root ::= "z"'), ("grammar", 'root ::= "z"'))):
        for cls in (CompletionRequest, ChatCompletionRequest):
            was, now = spec({old[0]: old[1]}, cls), spec({"structured_outputs": {new[0]: new[1]}}, cls)
            assert (was[0], now[0]) == (old[0], "structured_outputs") and was[1] == now[1]
    for sglang, new in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar")):
        text = {"json": json.dumps(OBJ), "regex": "a+", "grammar": 'root ::= "z"'}[new]
        assert spec({sglang: text})[1] == spec({"structured_outputs": {new: text}})[1]
    assert spec({}) is None and spec({"response_format": {"type": "text"}}) is None
    assert closed({"type": "object", "properties": {"p": {"type": "object"}}, "additionalProperties": True}) == \
        {"type": "object", "properties": {"p": {"type": "object", "additionalProperties": False}},
         "additionalProperties": True}


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"structured_outputs": {"json": OBJ, "json_object": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"begin": "<x>"}}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "unknown": 1}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
    ({"regex": "a", "guided_regex": "a"}, "regex"),
    ({"ebnf": "root ::= ("}, "ebnf"),
    ({"guided_choice": ["x" * 70_000]}, "guided_choice"),
    ({"guided_choice": ["x" * 40_000, "y" * 40_000]}, "guided_choice"),
])
def test_what_cannot_be_honoured_is_a_400_naming_its_parameter(body, param):
    with pytest.raises(ApiError) as err:
        constraint_of(parse(CompletionRequest, {"model": "m", "prompt": "x", **body}))
    assert err.value.status == 400 and err.value.param == param, err.value.message
