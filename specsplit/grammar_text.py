"""A ``GrammarSpec`` as the llguidance grammar it names. No torch: the API checks a request's
constraint with it before anything is generated, the engines compile with it
(``specsplit.engine.grammar``)."""

from __future__ import annotations


def llguidance_grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a GrammarSpec's ``kind`` and ``text``; ValueError or TypeError
    when it is none."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    return LLMatcher.grammar_from_lark(text)


def grammar_error(kind: str, text: str) -> str:
    """Why llguidance cannot enforce that grammar; "" when it can (its warnings are no error)."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(llguidance_grammar(kind, text))
    except Exception as exc:  # noqa: BLE001  (whatever a client's grammar does is the client's 400)
        return str(exc) or type(exc).__name__
    return "" if not error or error.startswith("WARNING") else error
