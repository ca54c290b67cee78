"""The served model's tokenizer, loaded alone: no torch, no weights, no provisioning.

``keep_torch_out()`` makes this process's transformers a tokenizers-only install (it would import
torch for its model code otherwise: ~1 s and ~200 MB a process); the tokenizer it loads is the
one the workers fingerprint, transformers' own reading of the same files.

The workers provision the models (``specsplit models pull``, or on first start); a process that
only turns text into token ids (the HTTP API, ``specsplit produce``) waits for the target model
directory to be complete and loads its tokenizer files. ``ServedTokenizer.fingerprint`` is the
hash the workers report to their router (``specsplit.models.tokenizer_fingerprint``), so a client
can check it holds the fleet's tokenizer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from specsplit.models.loading import DEFAULT_CACHE_DIR, tokenizer_fingerprint
from specsplit.models.presets import DEFAULT_PRESET, TINY_NAME, get_preset
from specsplit.models.pull import is_provisioned
from specsplit.vocab import end_ids, llama_eog_ids, token_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_PIECES = 65536  # tokens whose text and bytes token_piece keeps
# fill-in-the-middle tokens in the order a prompt holds them (before the gap, after it, the gap):
# Qwen2.5-Coder's, StarCoder's and SantaCoder's, DeepSeek-Coder's
FIM_STYLES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"))
REPO_STYLES = (("<|repo_name|>", "<|file_sep|>"), ("<repo_name>", "<file_sep>"))


def keep_torch_out() -> None:
    """Make ``import torch`` fail in this process (unless it is imported already), so transformers
    runs as a tokenizers-only library: call it first thing in a process that must stay light."""
    import sys

    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # importlib: find_spec -> None, import -> ImportError
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" line


def target_model_dir(settings) -> tuple[Path, str | None]:
    """(the target model directory the workers load, the source sha256 that marks it complete or
    None), computed without provisioning anything."""
    cache_dir = Path(getattr(settings, "cache_dir", None) or DEFAULT_CACHE_DIR).expanduser()
    override = getattr(settings, "target_model", None)
    if override:
        p = Path(override).expanduser()
        if p.suffix.lower() == ".gguf":
            from specsplit.models.loading import _cached_sha256

            sha = _cached_sha256(p.resolve(), cache_dir / "models")
            return cache_dir / "models" / f"gguf-{sha[:16]}", sha
        return p, None
    preset = get_preset(getattr(settings, "preset", None) or DEFAULT_PRESET)
    if preset.is_tiny:
        return cache_dir / "models" / TINY_NAME / "target", None
    return cache_dir / "models" / preset.target.name, preset.target.gguf_sha256


def wait_for_tokenizer_dir(settings, timeout_s: float, *, poll_s: float = 1.0, log=None) -> Path:
    """The target model directory once its tokenizer files are there (and, for a converted model,
    once its conversion is complete); TimeoutError after ``timeout_s``."""
    path, sha = target_model_dir(settings)
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        complete = sha is None or is_provisioned(path, sha)
        if complete and all((path / f).is_file() for f in TOKENIZER_FILES):
            return path
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no tokenizer in {path} after {timeout_s:.0f}s: start the workers or run "
                               "`specsplit models pull` to provision the models")
        if log is not None and not logged:
            log.info("waiting_for_tokenizer", path=str(path))
            logged = True
        time.sleep(poll_s)


class ServedTokenizer:
    """Text <-> ids for the served model, its chat template and its end-of-generation ids."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template to use instead of the model's own (its text)."""
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.fingerprint = tokenizer_fingerprint(self.tok)  # of the vocabulary and its processing: no template
        if chat_template is not None:
            self.tok.chat_template = chat_template
        self.chat_template: str | None = getattr(self.tok, "chat_template", None) or None
        self.has_chat_template = bool(self.chat_template)
        self.stop_token_ids = sorted(self._stop_ids())
        # llama.cpp's ends of generation (llama-server's endpoints stop at them): the stop ids and
        # the FIM pad / repository / file-separator and end-of-turn tokens it knows by text
        self.eog_token_ids = sorted(llama_eog_ids(self.tok, set(self.stop_token_ids)))
        self.added_tokens = frozenset(self.tok.get_added_vocab())  # e.g. "<tool_call>": one token each
        self.fim = next((style for style in FIM_STYLES if set(style) <= self.added_tokens), None)
        # a repository's files before the FIM prompt (Qwen2.5-Coder's, StarCoder2's): the repository's
        # name and each file's separator
        self.fim_repo = next((style for style in REPO_STYLES if set(style) <= self.added_tokens), None)
        self.bos = [int(self.tok.bos_token_id)] if getattr(self.tok, "add_bos_token", False) and \
            self.tok.bos_token_id is not None else []  # what a prompt begins with
        self.vocab_size = len(self.tok)
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's, bounded (MAX_PIECES)

    def _stop_ids(self) -> set[int]:
        """The tokenizer's eos and the generation config's end ids (as ``specsplit produce``)."""
        return end_ids(self.tok, self.path)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text)]

    def encode_text(self, text: str) -> list[int]:
        """``text`` as an answer spells it: no special tokens added (a predicted output)."""
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: no special tokens added, and none read from their names in it
        (code that spells ``<|fim_prefix|>`` is those characters)."""
        return [int(t) for t in self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]

    def ids_of(self, names: Sequence[str]) -> list[int]:
        """The ids of added tokens, by name."""
        return [int(t) for t in self.tok.convert_tokens_to_ids(list(names))]

    def infill(self, before: str | list[int], after: str) -> str | list[int]:
        """The fill-in-the-middle prompt for the gap between ``before`` and ``after`` (the model's
        own tokens, ``fim``: not None): text for a text ``before``, token ids for ids."""
        pre, suf, mid = self.fim
        if isinstance(before, str):
            return f"{pre}{before}{suf}{after}{mid}"
        ids = [int(t) for t in self.tok.convert_tokens_to_ids([pre, suf, mid])]
        return [ids[0], *before, ids[1], *self.encode_text(after), ids[2]]

    def encode_chat(self, turns: list[dict], tools: list[dict] | None = None, prefill: str = "",
                    variables: dict | None = None, opened: bool = True) -> list[int]:
        """The conversation through the model's chat template, ready for the assistant's turn
        (shown ``tools`` when given), which begins with ``prefill``; ``variables``: more of the
        template's (a request's ``chat_template_kwargs``); ``opened`` false: without the
        assistant's opening (vLLM's ``add_generation_prompt: false``)."""
        kw = variables or {}
        if prefill:
            text = self.tok.apply_chat_template(turns, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
            return [int(t) for t in self.tok(text + prefill, add_special_tokens=False)["input_ids"]]
        ids = self.tok.apply_chat_template(turns, tools=tools, add_generation_prompt=opened, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """A token alone: its text (a character it holds only part of shows as U+FFFD) and its
        bytes (OpenAI's ``bytes``: the parts of such a character), for logprobs."""
        hit = self._pieces.get(token_id)
        if hit is None:
            hit = self._pieces[token_id] = (self.tok.decode([token_id]), self._token_bytes(token_id))
            while len(self._pieces) > MAX_PIECES:
                self._pieces.pop(next(iter(self._pieces)))
        return hit

    def _token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.tok, token_id, self.added_tokens)
