"""The anchor system of `specsplit bench`: the target alone through llama.cpp's ``llama-completion``.

Same GGUF file the project provisions (kept by ``specsplit models pull --keep``), same
chat-formatted prompt text (the bench's PromptCodec output, given as text with llama.cpp's own
templating off), greedy, stopping at EOS. Seconds are llama.cpp's own prompt eval + eval times
(its ``common_perf_print`` lines on stderr), so model loading and its warmup are not counted.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specsplit.bench.systems import Answer

BIN_ENV = "SPECSPLIT_LLAMACPP_BIN"  # a llama.cpp build's bin dir (no settings class reads it)
BINARY = "llama-completion"
BUILD_HINT = "run ../shared/tools/build-llamacpp.sh (it prints its bin dir)"
END_OF_TEXT = " [end of text]\n"  # printed by llama-completion when it samples an end-of-generation token
TAIL = "\n\n"  # printed by llama-completion after the generated text, before its timings

_PROMPT = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([0-9.]+) ms /\s*(\d+) runs")
_TOTAL = re.compile(r"total time =\s*([0-9.]+) ms")


class LlamaCppError(RuntimeError):
    """llama-completion failed or printed no timings."""


@dataclass(frozen=True)
class LlamaTimings:
    """llama.cpp's own counts for one completion (``common_perf_print``)."""

    prompt_ms: float
    prompt_tokens: int
    eval_ms: float
    eval_runs: int
    total_ms: float

    @property
    def seconds(self) -> float:
        return (self.prompt_ms + self.eval_ms) / 1000.0

    @property
    def new_tokens(self) -> int:
        # the first token is sampled from the prompt eval; every later one costs one eval run
        # (a token that ends the answer, EOS or the n-th, is sampled but never evaluated)
        return self.eval_runs + 1


def parse_timings(stderr: str) -> LlamaTimings:
    """The last completion's timings from llama-completion's stderr."""
    prompt, evals, total = _PROMPT.findall(stderr), _EVAL.findall(stderr), _TOTAL.findall(stderr)
    if not prompt or not evals:
        tail = "\n".join(stderr.strip().splitlines()[-10:])
        raise LlamaCppError(f"no 'prompt eval time' / 'eval time' lines in llama.cpp's output:\n{tail}")
    return LlamaTimings(float(prompt[-1][0]), int(prompt[-1][1]), float(evals[-1][0]), int(evals[-1][1]),
                        float(total[-1]) if total else 0.0)


def parse_output(stdout: str) -> tuple[str, bool]:
    """(generated text, whether it ended at an end-of-generation token) from llama-completion's
    stdout run with ``--no-display-prompt``."""
    text = stdout.removesuffix(TAIL)
    if text.endswith(END_OF_TEXT):
        return text.removesuffix(END_OF_TEXT), True
    return text, False


def find_binary(bin_dir: str | Path | None) -> Path:
    """The ``llama-completion`` binary in ``bin_dir``; a clear SystemExit without a build."""
    if not bin_dir:
        raise SystemExit(f"specsplit bench: the llamacpp system needs a llama.cpp build: {BUILD_HINT}, "
                         f"then pass --llamacpp-bin DIR or set {BIN_ENV}=DIR")
    path = Path(bin_dir).expanduser() / BINARY
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"specsplit bench: no executable {BINARY} in {bin_dir}: {BUILD_HINT}")
    return path


def kept_gguf(settings) -> Path:
    """The target's GGUF file: SPECSPLIT_TARGET_MODEL when it is a .gguf, else the joined GGUF
    that ``specsplit models pull --keep`` leaves under <cache>/downloads/<name>/."""
    from specsplit.models.presets import get_preset

    override = getattr(settings, "target_model", None)
    if override and str(override).lower().endswith(".gguf"):
        return Path(override).expanduser()
    preset = get_preset(settings.preset)
    if preset.is_tiny:
        raise SystemExit(f"specsplit bench: preset {preset.name!r} has no GGUF; pass --llamacpp-model FILE")
    name = preset.target.name
    path = Path(settings.cache_dir).expanduser() / "downloads" / name / f"{name}.gguf"
    if not path.is_file():
        raise SystemExit(f"specsplit bench: no kept GGUF at {path}: run `specsplit models pull --keep "
                         f"--preset {preset.name}` (delete {path.parents[2] / 'models' / name} first if it "
                         "was pulled without --keep) or pass --llamacpp-model FILE")
    return path


class LlamaCppRunner:
    """One ``llama-completion`` process per prompt: greedy, the templated prompt text as a file."""

    def __init__(self, binary: Path, model: Path, threads: int, tokenizer, timeout_s: float = 1800.0):
        self.binary, self.model, self.threads = binary, model, threads
        self.tok, self.timeout_s = tokenizer, timeout_s
        # llama.cpp runs slower under the fleet's OMP_WAIT_POLICY (docs/results.md, fbeb6cc)
        self.env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(binary.parent), os.environ.get("LD_LIBRARY_PATH", "")) if p)

    def command(self, prompt_file: str, n_prompt: int, max_new: int) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "-f", prompt_file, "-no-cnv", "--no-escape",
                "--no-display-prompt", "--special", "--temp", "0", "--top-k", "1", "--seed", "0",
                "-n", str(max_new), "-t", str(self.threads), "-c", str(n_prompt + max_new + 64)]

    def __call__(self, ids: list[int], max_new: int) -> Answer:
        text = self.tok.decode(ids, skip_special_tokens=False)  # exactly the bench's templated prompt
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="specsplit-llamacpp-") as f:
            f.write(text + "\n")  # -f drops one trailing newline; the template ends "assistant\n"
            f.flush()
            proc = subprocess.run(self.command(f.name, len(ids), max_new), env=self.env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=self.timeout_s)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
            raise LlamaCppError(f"{BINARY} exited {proc.returncode}:\n{tail}")
        timings = parse_timings(proc.stderr)
        generated, _ = parse_output(proc.stdout)
        # --special prints the end-of-generation token's text, so tokenizing gives it back too
        token_ids = [int(t) for t in self.tok.encode(generated, add_special_tokens=False)]
        return Answer(token_ids, timings.seconds, reported_tokens=timings.new_tokens,
                      extra={"prompt_tokens": timings.prompt_tokens,
                             "prompt_eval_seconds": round(timings.prompt_ms / 1000, 4),
                             "eval_seconds": round(timings.eval_ms / 1000, 4),
                             "total_seconds": round(timings.total_ms / 1000, 4)})
