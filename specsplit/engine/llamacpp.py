"""Engines on llama.cpp's kernels (GGUF weights through llama-cpp-python's C API).

On a CPU, llama.cpp's quantized kernels (Q4_K_M as the preset's GGUFs ship) run the 1.5B target
faster than torch's int8 (fbgemm) does (docs/results.md, commit aa0eaa5), so the draft and the
target verify with the same kernels a user of llama.cpp already runs. The request handling, tree
search and verification rules are the torch engines' (``DraftEngine`` / ``TargetEngine``): only
the cache and the forward differ.

One llama context per worker holds every session's KV in one *unified* cache; a cell is shared by
sequences (a bitset). Visibility in a llama.cpp batch is "same sequence and not a later position"
(the token's first sequence id decides), which gives tree attention:

- each session owns a *main* sequence: its committed tokens;
- target: every root->leaf path of the tree gets a scratch sequence (a copy of the main one's
  cells); a node is tagged with the sequences of every leaf below it, so it sees the prefix, its
  ancestors and itself. After the verdict, the main sequence takes the accepted path's cells and
  the scratch sequences are removed (the rejected nodes' cells become free);
- draft: every forwarded tree node owns a sequence = its parent's cells + its own, so a node
  forwarded later sees exactly its ancestors; a re-rooted tree hands the path to the main sequence.

Positions are ``cache_len + depth`` as in the torch engines. A target verifies the rounds of
several sessions in one decode (``verify_batch``: each token carries its own session's sequences,
so the shared decode computes what each round alone would, up to the kernels' shape rounding);
a draft builds the trees of several greedy sessions in lockstep, each step's node forwards in one
decode (``draft_batch``; with SPECSPLIT_DRAFT_MAX_BATCH_TOKENS set).
Exactness: llama.cpp's kernels are not batch-invariant (a multi-token forward may round
differently from one-token decodes: the weight GEMMs, and the flash-attention kernel's tiled /
split-KV paths), so a llama.cpp target's output equals its own plain greedy decoding except where
the two top logits are within that rounding. Sequence ids come from a bounded pool
(LLAMA_MAX_SEQ = 256 per context); a draft that finds the pool empty stops growing, and
sessions drafting in lockstep each grow within their share of it.
Engines contain no transport and no device policy: threads per forward size come from the
worker's backend (``threads_for``).

Modules: ``llamacpp_kv`` (a session's cells, what both engines share), ``llamacpp_target``,
``llamacpp_draft``; the context itself is ``llamacpp_model``.
"""

from specsplit.engine.llamacpp_draft import LlamaDraftEngine
from specsplit.engine.llamacpp_kv import LlamaKV
from specsplit.engine.llamacpp_model import MAX_SEQ, LlamaCppModel, LlamaOutOfCells, SeqPool, greedy_decode
from specsplit.engine.llamacpp_target import LlamaTargetEngine

__all__ = ["MAX_SEQ", "LlamaCppModel", "LlamaDraftEngine", "LlamaKV", "LlamaOutOfCells", "LlamaTargetEngine",
           "SeqPool", "greedy_decode"]
