"""GGUF → Hugging Face model directory (safetensors), run in a child process.

The dequantizing load peaks at several times the file size (~11 GB for the 1.5B target), so it runs
in its own process: the memory goes back to the OS when it exits, and an out-of-memory kill becomes
a ``ConversionError`` in the caller instead of killing a worker.
Child: ``main([GGUF, OUT_DIR, "--no-progress"?])``, started through ``python -c``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from specsplit.models.errors import ConversionError
from specsplit.models.fsutil import (
    MANIFEST_NAME,
    remove_quietly,
    replace_dir,
    temp_sibling,
    write_json_atomic,
)

# Used only when a GGUF file carries no chat template; both real model families speak ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def run_conversion(gguf: Path, final_dir: Path, manifest: dict, *, progress: bool = True) -> None:
    """Convert ``gguf`` into ``final_dir`` (atomically, with ``manifest``) in a child process."""
    tmp_dir = temp_sibling(final_dir)
    remove_quietly(tmp_dir)
    cmd = [sys.executable, "-c", "import sys; from specsplit.models.convert import main; "
           "sys.exit(main(sys.argv[1:]))", str(gguf), str(tmp_dir)]
    if not progress:
        cmd.append("--no-progress")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    started = time.monotonic()
    try:
        # stdout of the child goes to our stderr: callers may print JSON on stdout.
        rc = subprocess.run(cmd, stdout=sys.stderr.fileno() if _has_fileno() else None,
                            env=env, check=False).returncode
        if rc != 0:
            hint = " (killed: probably out of memory)" if rc in (-9, 137) else ""
            raise ConversionError(f"converting {gguf} failed with exit code {rc}{hint}")
        manifest = dict(manifest, convert_seconds=round(time.monotonic() - started, 1))
        write_json_atomic(tmp_dir / MANIFEST_NAME, manifest)
        replace_dir(tmp_dir, final_dir)
    finally:
        remove_quietly(tmp_dir)


def _has_fileno() -> bool:
    try:
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def convert_in_process(gguf: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Load ``gguf`` with transformers (dequantized, bf16) and save a plain safetensors model dir."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    bar = tqdm(total=4, desc=f"convert {gguf.name}", unit="step", disable=not progress)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.update(1)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    bar.update(1)
    _strip_quantization(model)
    _fix_generation_config(model, tokenizer)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    bar.update(1)
    tokenizer.save_pretrained(out_dir)
    bar.update(1)
    bar.close()


def _strip_quantization(model) -> None:
    """Make the dequantized model save as an ordinary checkpoint (no GGUF quantizer attached)."""
    import torch

    bad = [n for n, p in model.named_parameters() if not torch.is_floating_point(p)]
    if bad:
        raise ConversionError(f"parameters still packed after dequantizing: {bad[:3]}")
    model.hf_quantizer = None
    for config in {id(model.config): model.config, id(model.config.get_text_config()):
                   model.config.get_text_config()}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config


def _fix_generation_config(model, tokenizer) -> None:
    """eos: the tokenizer's eos plus ChatML's end markers when the vocab has them; pad: eos."""
    eos_ids: list[int] = []
    for token in (tokenizer.eos_token, "<|im_end|>", "<|endoftext|>"):
        if token is None or token not in tokenizer.get_vocab():
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    gen = model.generation_config
    if eos_ids:
        gen.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specsplit.models.convert")
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    convert_in_process(args.gguf.resolve(), args.out_dir, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
