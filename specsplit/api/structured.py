"""The constraint a request puts on its output, as the grammar its sessions carry (``GrammarSpec``):
OpenAI's ``response_format`` (``protocol.grammar_of``), or vLLM's structured outputs on either
completions endpoint, ``structured_outputs`` {json, regex, choice, grammar, json_object} (vLLM
0.12's) and the ``guided_*`` fields that came before it (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern``), so that code written for
vLLM runs here unchanged; and SGLang's ``json_schema``, ``regex`` and ``ebnf``. One constraint a
request (a 400 otherwise, as vLLM's).

All of them are enforced by llguidance, vLLM's ``guidance`` backend: a JSON schema as written
(``disable_any_whitespace``, ``whitespace_pattern`` and ``disable_additional_properties`` as vLLM
reads them), a regular expression the whole output matches (Rust's syntax), one of the choices
exactly, a grammar in Lark or llama.cpp's GBNF (converted by llguidance). A constraint the engine
cannot take is a 400 naming its parameter before anything is generated. No torch here.
"""

from __future__ import annotations

import json
from typing import Any

from schemas import GrammarSpec
from schemas.messages import MAX_GRAMMAR_CHARS
from specsplit.api.protocol import ApiError, StructuredOutputs, grammar_of
from specsplit.grammar_text import grammar_error

LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
SGLANG = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}  # SGLang's field -> structured_outputs' key


def constraint_of(req) -> tuple[str, GrammarSpec] | None:
    """(the parameter that asks, its grammar) for the request's constraint on the output; None:
    free text. A 400 for two constraints or one the grammar engine cannot take."""
    found: list[tuple[str, GrammarSpec]] = []
    fmt = grammar_of(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _of(so, "structured_outputs")))
    legacy = StructuredOutputs(json=req.guided_json, regex=req.guided_regex, choice=req.guided_choice,
                               grammar=req.guided_grammar, whitespace_pattern=req.guided_whitespace_pattern)
    asked = [name for name in LEGACY if getattr(req, name) is not None]
    if asked:
        found.append((asked[0], _of(legacy, asked[0])))
    elif req.guided_whitespace_pattern is not None:
        raise ApiError(400, "guided_whitespace_pattern needs guided_json", param="guided_whitespace_pattern")
    for name, key in SGLANG.items():
        if getattr(req, name) is not None:
            asked.append(name)
            found.append((name, _of(StructuredOutputs(**{key: getattr(req, name)}), name)))
    if len(found) > 1 or len(asked) > 1:
        names = sorted({name for name, _ in found} | set(asked))  # as vLLM: one kind of constraint
        raise ApiError(400, f"one constraint on the output at a time: {', '.join(names)} were sent",
                       param=names[-1])
    return found[0] if found else None


KINDS = {"json_": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _of(so: StructuredOutputs, param: str) -> GrammarSpec:
    """The grammar ``so`` asks for (a 400 naming ``param`` for none, or more than one)."""
    kinds = [name for field, name in KINDS.items() if getattr(so, field) not in (None, False)]
    if len(kinds) > 1:
        raise ApiError(400, f"{param}: one of json, regex, choice, grammar, json_object at a time "
                            f"({', '.join(kinds)} were sent)", param=param)
    if so.json_ is not None:
        return _json_schema(so, param)
    if (so.whitespace_pattern is not None or so.disable_any_whitespace or so.disable_additional_properties) \
            and not so.json_object:
        raise ApiError(400, "whitespace_pattern, disable_any_whitespace and disable_additional_properties "
                            "shape a JSON answer: send them with json or json_object", param=param)
    if so.json_object:
        return _json_schema(so.model_copy(update={"json_": {"type": "object"}}), param)
    if so.regex is not None:
        return _checked(GrammarSpec(kind="regex", text=so.regex) if so.regex else None, param, "regex")
    if so.choice is not None:
        return _checked(_spec("lark", "start: " + " | ".join(json.dumps(c) for c in so.choice), param), param,
                        "choice")
    if so.grammar is not None:
        return _checked(_spec("lark", _lark(so.grammar, param), param), param, "grammar")
    raise ApiError(400, f"{param} asks for nothing: send one of json, regex, choice, grammar, json_object",
                   param=param)


def _json_schema(so: StructuredOutputs, param: str) -> GrammarSpec:
    schema: Any = so.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(400, f"{param}: the JSON schema is no JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise ApiError(400, f"{param}: a JSON schema is an object", param=param)
    if isinstance(schema, dict):
        if so.disable_additional_properties:
            schema = closed(schema)
        options = {}
        if so.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if so.whitespace_pattern is not None:
            options["whitespace_pattern"] = so.whitespace_pattern
        if options:
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return _checked(_spec("json_schema", json.dumps(schema), param), param, "json")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lark(text: str, param: str) -> str:
    """A grammar as Lark: Lark as it is, llama.cpp's GBNF converted (llguidance's converter)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001  (whatever a client's grammar does is the client's 400)
        raise ApiError(400, f"{param}: the grammar is neither Lark nor GBNF: {str(exc)[:300]}", param=param) from None


def _spec(kind: str, text: str, param: str) -> GrammarSpec:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"{param}: the constraint is over {MAX_GRAMMAR_CHARS} characters", param=param)
    return GrammarSpec(kind=kind, text=text)


def _checked(spec: GrammarSpec | None, param: str, what: str) -> GrammarSpec:
    """``spec`` if the grammar engine takes it; else a 400 naming ``param``."""
    if spec is None:
        raise ApiError(400, f"{param}: the {what} is empty", param=param)
    error = grammar_error(spec.kind, spec.text)
    if error:
        raise ApiError(400, f"{param}: the {what} cannot be enforced: {error[:300]}", param=param)
    return spec
