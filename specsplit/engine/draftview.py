"""The draft's partial view of a long context: attention sinks + a recent window.

A draft only proposes (the target verifies every token), so what its forwards attend to is a
speed choice that can never change the output. Past ``sink_tokens + window_tokens`` cached
tokens, every draft forward (tree levels, growth, the chunks of a long prompt) attends to the
first ``sink_tokens`` (attention sinks, which keep softmax anchored) and the last
``window_tokens`` cached tokens, plus its own new tokens (StreamingLLM's view; the RFC's "same
partial view for other draft modes"). The session's cache still holds every token, with its
real position (RoPE is applied before caching), so nothing is evicted or re-encoded and the
session's rollback, compaction and CACHE_MISS rules are untouched. Long-range copies are
still proposed at no model cost by the orchestrator's prompt lookup.

Cost: a draft forward grows with the cached tokens it attends to (docs/results.md, commit
6362e12); with a 2K window it costs about what it does at 2K cached tokens at any context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.engine.batch import _base_attention, register_wrapper

_PREFIX = "specsplit_window_"
WINDOW_KWARG = "specsplit_window"


@dataclass(frozen=True, slots=True)
class DraftWindow:
    """``window_tokens`` 0: the draft always attends to the whole context."""

    sink_tokens: int = 64
    window_tokens: int = 2048

    def bounds(self, cached: int) -> tuple[int, int] | None:
        """(sink_end, window_start) in cached tokens, or None when the view is the whole cache."""
        if self.window_tokens <= 0 or cached <= self.sink_tokens + self.window_tokens:
            return None
        return self.sink_tokens, cached - self.window_tokens


def _make_window_attention(base_name: str):
    def window_attention(module, query, key, value, attention_mask, *args, specsplit_window=None, **kwargs):
        """key/value [1, Hkv, P+T, D] (cache + new tokens), attention_mask [1, 1, T, P+T]: with a
        window (sink_end, start), attention runs over columns [0, sink_end) and [start, P+T)."""
        base = _base_attention(base_name, module)
        if specsplit_window is not None:
            sink, start = specsplit_window
            length = key.shape[2]
            key = torch.cat([key[:, :, :sink], key[:, :, start:]], dim=2)
            value = torch.cat([value[:, :, :sink], value[:, :, start:]], dim=2)
            attention_mask = torch.cat([attention_mask[..., :sink], attention_mask[..., start:length]], dim=-1)
        return base(module, query, key, value, attention_mask, *args, **kwargs)

    return window_attention


def window_attention_name(model) -> str | None:
    """The name under which the window wrapper of ``model``'s attention is registered, or None
    when its attention takes no custom additive mask (flash, flex, paged kernels)."""
    return register_wrapper(model, _PREFIX, _make_window_attention)
