"""llama.cpp underneath the llama engines: a GGUF model with one context (a unified KV cache
shared by sequences), its sequence-id pool, and plain greedy decoding (the llama target's
reference). Through llama-cpp-python's C API; no engine logic here (``specsplit.engine.llamacpp``).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path
from typing import Callable

import numpy as np

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ


def _lib():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("the llamacpp engine needs llama-cpp-python, an optional part of SpecSplit compiled "
                           "for this CPU: run `./ops/setup.sh gguf` (or pip install -e '.[gguf]')") from exc
    return llama_cpp


_backend_lock = threading.Lock()
_backend_ready = False


def _init_backend(quiet: bool) -> None:
    global _backend_ready
    lib = _lib()
    with _backend_lock:
        if not _backend_ready:
            if quiet:  # llama.cpp logs every load at INFO on stderr; the worker logs what matters
                _silence(lib)
            lib.llama_backend_init()
            _backend_ready = True


_LOG_CB = None
_LOG_ERROR, _LOG_CONT = 3, 5  # GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT


def _silence(lib) -> None:
    """llama.cpp logs every load and context at INFO on stderr: keep its errors only."""
    global _LOG_CB
    last = [0]

    def cb(level, text, _user_data):
        level = last[0] if level == _LOG_CONT else level
        last[0] = level
        if level == _LOG_ERROR:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_CB = lib.llama_log_callback(cb)  # kept referenced: llama.cpp holds the pointer
    lib.llama_log_set(_LOG_CB, ctypes.c_void_p())


class LlamaOutOfCells(Exception):
    """The unified cache has no room for a forward's tokens."""


class LlamaCppModel:
    """A GGUF model with one context: a unified KV cache of ``n_ctx`` cells shared by up to
    ``n_seq`` sequences. Not thread-safe by itself: callers hold ``lock``."""

    def __init__(self, path: str | Path, *, n_ctx: int = 32768, n_seq: int = MAX_SEQ, n_batch: int = 512,
                 threads: int = 1, prefill_threads: int = 1, quiet: bool = True):
        lib = self.lib = _lib()
        _init_backend(quiet)
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max = min(n_seq, MAX_SEQ)
        cp.n_threads, cp.n_threads_batch = threads, prefill_threads
        cp.kv_unified = True
        # flash attention (llama.cpp's default on CPU): its kernel accumulates V in f16 in cell
        # order, so a target never frees cells one by one (LlamaTargetEngine's trash sequence):
        # cells stay in position order and a token's logits do not depend on where freed cells
        # were refilled (they differ otherwise: docs/results.md, commit aa0eaa5)
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO
        cp.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {self.path} (n_ctx={n_ctx})")
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_seq = cp.n_seq_max
        self.n_batch = n_batch
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        # K and V of one token, f16, every layer (the context's default cache types)
        head_dim = lib.llama_model_n_embd(self.model) // max(1, lib.llama_model_n_head(self.model))
        self.bytes_per_cell = 2 * 2 * lib.llama_model_n_layer(self.model) * lib.llama_model_n_head_kv(self.model) * head_dim
        self.batch = lib.llama_batch_init(n_batch, 0, self.n_seq)
        self.lock = threading.RLock()
        self.threads_for: Callable[[int], int] = lambda n: threads if n <= 64 else prefill_threads
        self._threads = (threads, prefill_threads)
        self.cells_used = 0  # cells held by sequences (bookkeeping of this wrapper, for metrics)

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "ctx", None):
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)
            lib.llama_model_free(self.model)
            self.ctx = None

    # ---- memory -----------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return self.lib.llama_memory_seq_pos_max(self.mem, seq)

    # ---- forward ----------------------------------------------------------------------
    def decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], outputs: list[int]) -> np.ndarray:
        """One llama_decode of T tokens (T <= n_batch): token i at ``positions[i]`` in the
        sequences ``seqs[i]`` (the first decides what it sees). Returns float32 logits of the
        tokens listed in ``outputs`` (ascending batch indices) [len(outputs), V], a copy.
        Raises LlamaOutOfCells when the cache has no room (nothing changed)."""
        t = len(tokens)
        assert 0 < t <= self.n_batch and len(positions) == t and len(seqs) == t
        b = self.batch
        out = set(outputs)
        for i in range(t):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            row = seqs[i]
            b.n_seq_id[i] = len(row)
            sid = b.seq_id[i]
            for j, s in enumerate(row):
                sid[j] = s
            b.logits[i] = 1 if i in out else 0
        b.n_tokens = t
        threads = self.threads_for(t)
        self.lib.llama_set_n_threads(self.ctx, threads, threads)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc == 1:
            raise LlamaOutOfCells(f"no room for {t} tokens in the {self.n_ctx}-cell cache")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc}")
        if not outputs:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        ptr = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(outputs), self.vocab_size)).copy()


class SeqPool:
    """Sequence ids of one context: a bounded free list."""

    def __init__(self, n_seq: int):
        self.n_seq = n_seq
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.n_seq - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, seq: int) -> None:
        self._free.append(seq)

    def __len__(self) -> int:
        return len(self._free)


def greedy_decode(lm: LlamaCppModel, prompt_ids: list[int], max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Plain greedy decoding on ``lm`` (the prompt, then one token per decode): the reference a
    llama.cpp target's speculative output is compared with, and the bench's target-alone row.
    Takes the whole context: it is cleared first (an engine on it loses its sessions)."""
    stop = set(int(s) for s in stop_token_ids)
    out: list[int] = []
    seq = 0
    with lm.lock:
        lm.lib.llama_memory_clear(lm.mem, True)
        try:
            logits = None
            for a in range(0, len(prompt_ids), lm.n_batch):
                part = prompt_ids[a:a + lm.n_batch]
                logits = lm.decode(part, list(range(a, a + len(part))), [[seq]] * len(part), [len(part) - 1])
            pos = len(prompt_ids)
            while len(out) < max_new_tokens:
                token = int(np.argmax(logits[0]))
                out.append(token)
                if token in stop or len(out) == max_new_tokens:
                    break
                logits = lm.decode([token], [pos], [[seq]], [0])
                pos += 1
        finally:
            lm.seq_rm(seq)
    return out
