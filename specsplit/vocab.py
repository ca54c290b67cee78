"""What a transformers tokenizer says about its tokens, without torch: each token's bytes, and the
tokens llama.cpp ends a generation at.

``token_bytes`` is a token alone as bytes (OpenAI's logprobs ``bytes``). ``llama_pieces`` is
llama.cpp's ``token_to_piece(..., special=false)`` for every token: a control token (an added
token marked special, or one llama.cpp reads as an end of generation) is empty there, which is
what llama.cpp's ``infill`` sampler compares. ``llama_eog_ids`` is llama.cpp's end-of-generation
set (``llama_vocab_is_eog``): the end ids, the FIM pad / repository / file-separator tokens and
the end-of-turn tokens it knows by their text (llama.cpp's ``llama-vocab.cpp``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# llama.cpp's end-of-turn tokens, in the order SpecSplit picks its EOT from (llama.cpp takes the
# first its hash map yields); each also ends a generation
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
EOG_TEXTS = (*EOT_TEXTS, "<|eom_id|>", "<|return|>", "<|call|>", "[EOS]")
# fill-in-the-middle pad, repository and file-separator tokens: ends of generation for llama.cpp
FIM_EOG_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                 "<REPO>", "<reponame>", "<|file_sep|>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2's map: printable bytes as themselves, the others
    shifted past U+0100) -> the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


BYTE_OF = _byte_level_alphabet()


def piece_bytes(piece: str, added: bool) -> bytes:
    """A token's vocabulary entry (``convert_ids_to_tokens``) as the bytes it stands for."""
    if added:
        return piece.encode()
    if all(ch in BYTE_OF for ch in piece):  # byte-level BPE (GPT-2's, Qwen's, Llama 3's)
        return bytes(BYTE_OF[ch] for ch in piece)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary


def token_bytes(tok, token_id: int, added: frozenset[str] | set[str]) -> bytes:
    """Token ``token_id`` alone as bytes (an added token: its text); b"" past the vocabulary."""
    piece = tok.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return b""
    return piece_bytes(piece, piece in added)


def end_ids(tok, model_dir: str | Path | None) -> set[int]:
    """The tokenizer's eos and the generation config's end ids (where the API stops)."""
    stops = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    if model_dir is None:
        return stops
    try:
        eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return stops
    stops.update([eos] if isinstance(eos, int) else [int(e) for e in eos or []])
    return stops


def llama_eog_ids(tok, ends: set[int]) -> set[int]:
    """llama.cpp's end-of-generation tokens: ``ends`` and the added tokens it knows by text."""
    added = tok.get_added_vocab()
    return set(ends) | {int(added[t]) for t in (*EOG_TEXTS, *FIM_EOG_TEXTS) if t in added}


def llama_eot_id(tok, ends: set[int]) -> int:
    """The token llama.cpp's ``infill`` sampler ends with when nothing else is left: its EOT (an
    end-of-turn token known by text), else the eos."""
    added = tok.get_added_vocab()
    for text in EOT_TEXTS:
        if text in added:
            return int(added[text])
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    return min(ends) if ends else 0


def llama_pieces(tok, eog: set[int], size: int) -> list[bytes]:
    """``token_to_piece(id, special=false)`` of llama.cpp for ids 0..size-1: control tokens (added
    tokens marked special, ends of generation) and ids past the tokenizer are b"". One pass over
    the vocabulary (~0.3 s for 152K tokens)."""
    control = {int(i) for i, t in tok.added_tokens_decoder.items() if t.special} | set(eog)
    user = {int(i) for i, t in tok.added_tokens_decoder.items() if not t.special}
    names = tok.convert_ids_to_tokens(list(range(min(size, len(tok)))))
    out = [b""] * size
    for i, name in enumerate(names):
        if i in control or not isinstance(name, str):
            continue
        out[i] = piece_bytes(name, i in user)
    return out
