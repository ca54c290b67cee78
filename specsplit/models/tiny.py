"""A deterministic random draft/target pair for tests and local runs, built offline in a second.

Target: a tiny ``Qwen2ForCausalLM`` with weights drawn at std 0.3 (so greedy logits are not near
ties). Draft: the same architecture, the target's weights plus seeded noise, so it agrees with the
target often but not always. Tokenizer: byte-level BPE whose merges are learned by a small,
deterministic pure-Python trainer from a built-in corpus (no dependence on hash order or threads).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from specsplit.logs import get_logger
from specsplit.models.fsutil import (
    MANIFEST_NAME,
    file_lock,
    read_manifest,
    remove_quietly,
    remove_stale_temps,
    replace_dir,
    temp_sibling,
    write_json_atomic,
)
from specsplit.models.presets import ModelPaths

TINY_VERSION = 1
WEIGHT_STD = 0.3
DRAFT_NOISE_STD = 0.0075  # ~70% greedy agreement on random text, ~85% on the target's own
N_MERGES = 160
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)

CORPUS = """\
The draft model proposes a tree of tokens and the target model verifies the whole tree at once.
When the draft agrees with the target, several tokens are accepted in a single forward pass.
A session keeps its key and value cache on one worker; the router picks that worker by hash.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for i in range(2, int(n ** 0.5) + 1):
        if n % i == 0:
            return False
    return True

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
User: write a function that returns the sum of a list. Assistant: here is the function.
import numpy as np
import torch
print("hello world")
for i in range(10): print(i, i * i)
"""


def build_tiny_pair(out_dir: str | Path, *, seed: int = 0, lock_timeout_s: float = 600.0) -> ModelPaths:
    """Build (once) ``out_dir/{draft,target}``: deterministic for a given ``seed``, atomic, locked."""
    out_dir = Path(out_dir).expanduser()
    paths = ModelPaths(draft=out_dir / "draft", target=out_dir / "target")
    if _is_built(out_dir, seed):
        return paths
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.with_name(f".{out_dir.name}.lock"), timeout_s=lock_timeout_s,
                   what=f"building {out_dir.name}"):
        if _is_built(out_dir, seed):
            return paths
        remove_stale_temps(out_dir)
        tmp = temp_sibling(out_dir)
        try:
            _build_into(tmp, seed)
            write_json_atomic(tmp / MANIFEST_NAME, {"kind": "tiny", "tiny_version": TINY_VERSION,
                                                    "seed": seed})
            replace_dir(tmp, out_dir)
        finally:
            remove_quietly(tmp)
        get_logger().info("tiny_pair_built", path=str(out_dir), seed=seed)
    return paths


def _is_built(out_dir: Path, seed: int) -> bool:
    manifest = read_manifest(out_dir)
    return bool(manifest) and manifest.get("tiny_version") == TINY_VERSION \
        and manifest.get("seed") == seed


def _build_into(root: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = -(-len(tokenizer) // 64) * 64  # round up to a multiple of 64
    config = Qwen2Config(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id,
                         bos_token_id=None, dtype="float32", **ARCH)
    generation = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    target = Qwen2ForCausalLM(config)
    _fill_params(target, torch.Generator().manual_seed(seed), None)
    draft = Qwen2ForCausalLM(config)
    _fill_params(draft, torch.Generator().manual_seed(seed + 1_000_003), target)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = generation
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)


def _fill_params(model, gen, base) -> None:
    """std-0.3 normal weights (norms 1), or ``base``'s weights plus ``DRAFT_NOISE_STD`` noise."""
    import torch

    base_params = dict(base.named_parameters()) if base is not None else {}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if base is not None:
                noise = torch.randn(param.shape, generator=gen) * DRAFT_NOISE_STD
                param.copy_(base_params[name] + noise)
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)


def build_tiny_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast``: 256 bytes + learned merges + ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    merges = _train_merges([w for w, _ in pre.pre_tokenize_str(CORPUS)], N_MERGES)
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _train_merges(words: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair, ties broken by the pair itself."""
    counts = Counter(words)
    seqs = {w: list(w) for w in counts}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in counts.items():
            s = seqs[word]
            for pair in zip(s, s[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        seqs = {w: _merge_pair(s, best) for w, s in seqs.items()}
    return merges


def _merge_pair(seq: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]
