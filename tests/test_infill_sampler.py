"""llama.cpp's ``infill`` sampler (``specsplit.engine.infill``): against llama.cpp's own, through
llama-cpp-python on SmolLM2's vocabulary (the same tokens, pieces and ends of generation, and the
same survivors on rows built to merge, to end and to cut); as a choice of tokens in the engines'
probabilities; and the verifier's draws keep its distribution (a chi-square fit that can fail)."""

from __future__ import annotations

import ctypes
import random
from collections import Counter

import numpy as np
import pytest
import torch

from schemas import FlatTree, SamplingSpec
from specsplit.engine import sampling as S
from specsplit.engine.infill import InfillVocab
from specsplit.engine.verify import verify_sampling
from specsplit.tree import validate_tree
from tests.sampling_oracle import ALPHA, chi2_fit


# ---- llama.cpp itself ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_vocab():
    """(llama.cpp's vocabulary of SmolLM2's GGUF, its infill sampler, the HF tokenizer and
    model dir of the same model)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the gguf extra")
    from transformers import AutoTokenizer

    from specsplit.models import ModelSettings
    from specsplit.models.loading import resolve_gguf, resolve_model_paths

    settings = ModelSettings(preset="smollm2")
    gguf = resolve_gguf("target", settings)
    model_dir = resolve_model_paths(settings, progress=False).target
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    assert model, gguf
    vocab = llama_cpp.llama_model_get_vocab(model)
    sampler = llama_cpp.llama_sampler_init_infill(vocab)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    yield llama_cpp, vocab, sampler, tok, model_dir
    llama_cpp.llama_sampler_free(sampler)
    llama_cpp.llama_model_free(model)


def _llama_piece(llama_cpp, vocab, token: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    assert n >= 0
    return buf.raw[:n]


def _llama_infill(llama_cpp, sampler, ids: list[int], logits: list[float]) -> list[int]:
    """llama.cpp's infill sampler on candidates (ids, logits): the ids it leaves."""
    data = (llama_cpp.llama_token_data * len(ids))(*[llama_cpp.llama_token_data(t, x, 0.0)
                                                       for t, x in zip(ids, logits, strict=True)])
    arr = llama_cpp.llama_token_data_array(data=data, size=len(ids), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
    return [data[i].id for i in range(arr.size) if data[i].logit != float("-inf")]


def test_pieces_and_ends_of_generation_are_llama_cpps(llama_vocab):
    llama_cpp, vocab, _, tok, model_dir = llama_vocab
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    ours = InfillVocab.for_tokenizer(tok, model_dir, n)
    assert ours.pieces == [_llama_piece(llama_cpp, vocab, t) for t in range(n)]
    assert ours.eog == {t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    # its EOT: one of the end-of-turn tokens it knows by text (which one, where a vocabulary has
    # several, follows its hash map's order); ours is an end of generation too
    assert ours.eot in ours.eog and llama_cpp.llama_vocab_eot(vocab) in ours.eog


def _rows(tok, vocab: InfillVocab, count: int, seed: int) -> list[tuple[list[int], list[float]]]:
    """Candidate rows that exercise every branch: tokens with their prefixes among them (merges),
    ends of generation with some of the mass or most of it, flat and peaked logits."""
    rnd = random.Random(seed)
    by_piece = {p: i for i, p in enumerate(vocab.pieces) if p}
    words = [i for i, p in enumerate(vocab.pieces) if len(p) >= 3]
    eog = sorted(vocab.eog)
    rows = []
    for r in range(count):
        ids: list[int] = []
        for w in rnd.sample(words, rnd.randint(1, 6) if r % 4 else 0):  # a word and the tokens that begin it
            ids += [w] + [by_piece[vocab.pieces[w][:j]] for j in range(1, len(vocab.pieces[w]))
                          if vocab.pieces[w][:j] in by_piece and rnd.random() < 0.6]
        ids += rnd.sample(range(len(tok)), rnd.randint(0 if ids else 1, 30))
        if r % 3:
            ids += rnd.sample(eog, rnd.randint(1, len(eog)))
        ids = list(dict.fromkeys(ids))[:40]
        scale = rnd.choice([0.3, 1.0, 3.0, 8.0])
        logits = [rnd.gauss(0.0, scale) for _ in ids]
        if r % 5 == 0:  # an end of generation holding most of the mass
            logits = [x + (6.0 if t in vocab.eog else 0.0) for t, x in zip(ids, logits, strict=True)]
        rows.append((ids, logits))
    return rows


def test_the_survivors_are_llama_cpps(llama_vocab):
    llama_cpp, lvocab, sampler, tok, model_dir = llama_vocab
    vocab = InfillVocab.for_tokenizer(tok, model_dir, llama_cpp.llama_vocab_n_tokens(lvocab))
    branches, llama_eot = Counter(), llama_cpp.llama_vocab_eot(lvocab)
    for ids, logits in _rows(tok, vocab, 600, seed=5):
        x = torch.tensor(logits, dtype=torch.float64)
        p = torch.softmax(x, dim=0).numpy()[None]
        keep, forced = vocab.keep(np.array([ids]), p)
        ours = [llama_eot] if forced[0] else sorted(np.array(ids)[keep[0]].tolist())  # (its EOT: see above)
        theirs = sorted(_llama_infill(llama_cpp, sampler, ids, logits))
        assert ours == theirs, (ids, logits)
        merged = any(vocab.pieces[b].startswith(vocab.pieces[a]) for a in ids for b in ids
                     if a != b and vocab.pieces[a])
        branches["eot" if forced[0] else "eog" if all(t in vocab.eog for t in ours) else
                 "merged" if merged else "cut"] += 1
    assert min(branches[b] for b in ("eot", "eog", "merged", "cut")) >= 10, branches


# ---- the engines' probabilities ---------------------------------------------------------------
def toy_vocab() -> InfillVocab:
    """Ten tokens: 0 'a', 1 'ab', 2 'abc', 3 'b', 4 'c', 5 'cd', 6 'x', 7 'y', 8 an end, 9 'z'."""
    pieces = [b"a", b"ab", b"abc", b"b", b"c", b"cd", b"x", b"y", b"", b"z"]
    return InfillVocab(pieces, {8}, 8)


def expected(logits: list[float], vocab: InfillVocab, top_k: int, temperature: float = 1.0) -> np.ndarray:
    """The sampler's distribution by its definition: top-k, the survivors' own softmax."""
    x = np.array(logits, dtype=np.float64)
    top = np.argsort(-x, kind="stable")[:top_k]
    p = np.exp(x[top] - x[top].max())
    keep, forced = vocab.keep(top[None], (p / p.sum())[None])
    out = np.zeros(len(x))
    if forced[0]:
        out[vocab.eot] = 1.0
        return out
    kept = top[keep[0]]
    e = np.exp((x[kept] - x[kept].max()) / temperature)
    out[kept] = e / e.sum()
    return out


@pytest.mark.parametrize("logits", [
    [2.0, 1.9, 0.5, 1.0, 0.2, 0.1, -1.0, -1.0, -3.0, -2.0],  # 'a' 'ab' 'abc' merge; 'b' and 'c' cut
    [0.1, 0.0, -0.1, 0.2, 0.05, 0.0, 0.1, 0.0, -1.0, 0.0],  # flat: few pass 0.2
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0],  # the end holds enough: it alone
    [1.0, -5.0, -5.0, 1.0, 1.0, -5.0, 1.0, 1.0, -9.0, 1.0],  # six at 1/6 each: none passes 0.2, EOT
    [-5.0, -5.0, -5.0, 1.0, 1.0, 1.0, 1.0, 1.0, -9.0, 1.0],  # the same, but 'c' takes 'cd': 2/6 passes
])
@pytest.mark.parametrize("dense", [False, True])
def test_engine_probabilities_are_the_samplers_choice(logits, dense):
    vocab = toy_vocab()
    sampling = SamplingSpec(temperature=0.7, top_k=8, infill=True, temperature_last=True)
    row = torch.tensor([logits], dtype=torch.float32)
    if dense:  # the whole-vocabulary path (as with a tie at the k-th logit)
        probs = S.probs_from_logits(row, sampling.model_copy(update={"top_k": 0}), infill=vocab)
        want = expected(logits, vocab, 10, 0.7)
    else:
        probs = S.probs_from_logits(row, sampling, infill=vocab)
        want = expected(logits, vocab, 8, 0.7)
    np.testing.assert_allclose(probs[0].numpy(), want, atol=1e-12)


def test_top_k_rows_keep_unique_ids_when_a_row_ends():
    vocab = toy_vocab()
    logits = torch.tensor([[1.0, -5.0, -5.0, 1.0, 1.0, -5.0, 1.0, 1.0, -9.0, 1.0],
                           [2.0, 1.9, 0.5, 1.0, 0.2, 0.1, -1.0, -1.0, 4.0, -2.0]])
    probs, ids = S.top_k_rows(logits, 6, SamplingSpec(temperature=1.0, top_k=6, infill=True), vocab)
    assert [len(set(r)) for r in ids.tolist()] == [6, 6]
    assert probs[0, ids[0].tolist().index(8)] == 1.0  # its EOT alone, in a column of its own
    assert probs[1, ids[1].tolist().index(8)] == 1.0  # the end held enough of the mass


# ---- the verifier -------------------------------------------------------------------------------
def test_verification_keeps_the_infill_distribution():
    """Sampled trees verified with the infill sampler: the first token drawn fits the sampler's
    own distribution (chi-square, ALPHA); the draft proposes from its plain top-k distribution,
    so rejections and residual draws run too ('b', 'x' and 'y' survive of its eight). Without
    the sampler the same draws fail the fit."""
    vocab = toy_vocab()
    logits = torch.tensor([[-1.0, -2.0, -3.0, 1.0, -1.0, -2.0, 0.9, 0.8, -3.0, -0.5]] * 3, dtype=torch.float32)
    sampling = SamplingSpec(temperature=1.0, top_k=8, infill=True)
    want = expected(logits[0].tolist(), vocab, 8)
    q = S.probs_from_logits(logits[:1], sampling.model_copy(update={"infill": None}))[0]  # the draft's
    q_ids = [i for i in range(10) if q[i] > 0]
    q_probs = [float(q[i]) for i in q_ids]
    gen = torch.Generator().manual_seed(11)

    def first_tokens(infill: InfillVocab | None, trials: int) -> Counter:
        counts: Counter = Counter()
        for t in range(trials):
            kids = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
            tree = FlatTree(token_ids=[0, *kids], parents=[-1, 0, 0], child_dist_ids=[q_ids, [], []],
                            child_dist_probs=[q_probs, [], []])
            g = torch.Generator().manual_seed(1000 + t)
            verdict = verify_sampling(tree, validate_tree(tree, vocab_size=10, max_nodes=8, max_depth=4), logits,
                                      sampling, g, infill)
            counts[(tree.token_ids[verdict.path[1]] if len(verdict.path) > 1 else verdict.bonus,)] += 1
        return counts

    counts = first_tokens(vocab, 2000)
    fit = chi2_fit(counts, {(i,): float(p) for i, p in enumerate(want) if p > 0})
    assert fit.impossible == 0 and fit.p_value > ALPHA, (fit, counts, want)
    plain = first_tokens(None, 2000)
    assert chi2_fit(plain, {(i,): float(p) for i, p in enumerate(want) if p > 0}).p_value < ALPHA
