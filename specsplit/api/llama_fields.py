"""llama.cpp's request fields beside the ones a server honours, torch-free and shared by
llama-server's endpoints (``specsplit.api.llama_server``) and the OpenAI ones (clients written
for llama-server send them to its OpenAI endpoints too, e.g. llama.vscode's chat edits): which
change nothing here (``IGNORED``), which are honoured only when off (``OFF_ONLY``), and the
sampler chain (``samplers``) as the fleet applies it (``sampling_of``).
"""

from __future__ import annotations

from typing import Any

from specsplit.api.errors import ApiError

# llama-server's fields that change nothing about the answer here, at any value: slots and their
# cache options (the fleet's prefix caches work by content), context shifting (a prompt over the
# context is a 400), the parameters of samplers that are off, and options of its own output
IGNORED = frozenset({
    "model", "id_slot", "cache_prompt", "n_keep", "n_discard", "n_cache_reuse", "t_max_prompt_ms", "verbose",
    "sse_ping_interval", "stream_options", "repeat_last_n", "penalize_nl", "dynatemp_exponent", "xtc_threshold",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat_tau",
    "mirostat_eta", "adaptive_decay", "min_keep", "backend_sampling", "timings_per_token",
})
# llama-server's fields honoured only at the value that turns them off: name -> (is it off?, what is)
OFF_ONLY: dict[str, tuple[Any, str]] = {
    "repeat_penalty": (lambda v: v == 1, "1.0: llama.cpp's penalties count the last tokens only"),
    "frequency_penalty": (lambda v: v == 0, "0"),
    "presence_penalty": (lambda v: v == 0, "0"),
    "typical_p": (lambda v: v == 1, "1.0"),
    "top_n_sigma": (lambda v: v <= 0, "-1"),
    "xtc_probability": (lambda v: v == 0, "0"),
    "dynatemp_range": (lambda v: v == 0, "0"),
    "dry_multiplier": (lambda v: v == 0, "0"),
    "mirostat": (lambda v: v == 0, "0"),
    "adaptive_target": (lambda v: v < 0, "a negative value"),
    "n_probs": (lambda v: v == 0, "0 on the OpenAI endpoints: logprobs there"),
    "post_sampling_probs": (lambda v: v is False, "false: the probabilities are the model's, before sampling"),
    "lora": (lambda v: not v, "[]"),
    "return_progress": (lambda v: v is False, "false"),
    "grammar_lazy": (lambda v: v is False, "false"),
}
# llama.cpp's sampler names (and its aliases: kebab-case, no dash), and its one-letter codes
SAMPLERS = {"dry": "dry", "top_k": "top_k", "top_p": "top_p", "nucleus": "top_p", "top_n_sigma": "top_n_sigma",
            "typ_p": "typ_p", "typ": "typ_p", "typical_p": "typ_p", "min_p": "min_p", "temperature": "temperature",
            "temp": "temperature", "xtc": "xtc", "infill": "infill", "penalties": "penalties",
            "adaptive_p": "adaptive_p"}
SAMPLERS.update({k.replace("_", sep): v for k, v in list(SAMPLERS.items()) if "_" in k for sep in ("-", "")})
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def check_fields(fields: dict[str, Any]) -> None:
    """A 400 naming the first of ``fields`` (llama.cpp's) that is in ``OFF_ONLY`` but not off."""
    for name, value in fields.items():
        if name not in OFF_ONLY:
            continue
        off, what = OFF_ONLY[name]
        try:
            ok = off(value)
        except TypeError:
            ok = False
        if not ok:
            raise ApiError(400, f"{name} is not supported by this server (only {what})", param=name,
                           code="unsupported_parameter")


def chain_of(samplers: list[str] | str | None) -> list[str]:
    """The sampler chain asked for, by llama.cpp's canonical names (a 400 for a name it lacks)."""
    if samplers is None:
        return list(DEFAULT_CHAIN)
    names = [SAMPLER_CHARS.get(c) for c in samplers] if isinstance(samplers, str) else \
        [SAMPLERS.get(s.lower()) if isinstance(s, str) else None for s in samplers]
    if None in names:
        bad = list(samplers)[names.index(None)]
        raise ApiError(400, f"samplers: {bad!r} is no sampler of llama.cpp", param="samplers")
    return names


INFILL_MAX_TOP_K = 1024  # the infill sampler compares its candidates' pieces pairwise, on the host


def sampling_of(samplers: list[str] | str | None, temperature: float, top_k: int, top_p: float,
                min_p: float) -> tuple[dict, bool, list[str]]:
    """The OpenAI-side sampling fields, ``temperature_last``, and the chain as applied: the
    samplers of the chain that act (the others are off), in the fleet's order (top-k, top-p,
    min-p, infill; the temperature first or last); a 400 for an order it cannot keep.
    ``infill`` (llama.cpp's infill sampler, ``SamplingSpec.infill``) is in it where it acts."""
    chain = chain_of(samplers)
    if "adaptive_p" in chain:
        raise ApiError(400, "samplers: adaptive_p is not supported by this server", param="samplers")
    if len(set(chain)) < len(chain):
        raise ApiError(400, "samplers: a sampler named twice is not supported", param="samplers")
    acting = {"top_k": top_k > 0, "top_p": top_p < 1.0, "min_p": min_p > 0.0, "temperature": temperature != 1.0,
              "infill": True}
    used = [s for s in chain if acting.get(s)]
    cuts = [s for s in used if s in ("top_k", "top_p", "min_p")]
    if cuts != [s for s in ("top_k", "top_p", "min_p") if s in cuts]:
        raise ApiError(400, f"samplers: the order {cuts} is not supported (top_k, top_p, min_p in this order)",
                       param="samplers")
    if "infill" in used:
        if any(used.index(s) > used.index("infill") for s in cuts):
            raise ApiError(400, "samplers: infill before top_k, top_p or min_p is not supported", param="samplers")
        if not 0 < top_k <= INFILL_MAX_TOP_K or "top_k" not in used:
            raise ApiError(400, f"samplers: infill needs top_k (1 to {INFILL_MAX_TOP_K}) before it", param="samplers")
    last = False
    if "temperature" in used and temperature > 0:  # before or after every step its scale changes
        at = used.index("temperature")
        scaled = [s for s in used[at + 1:] if s in ("top_p", "min_p", "infill")]  # (top-k keeps the same tokens)
        before = [s for s in used[:at] if s in ("top_p", "min_p", "infill")]
        if scaled and before:
            raise ApiError(400, f"samplers: the temperature between {before[-1]} and {scaled[0]} is not supported",
                           param="samplers")
        last = bool(before)
    fields = {"temperature": temperature if "temperature" in used else 1.0,
              "top_k": top_k if "top_k" in used else 0, "top_p": top_p if "top_p" in used else 1.0,
              "min_p": min_p if "min_p" in used else 0.0}
    return fields, last, used
