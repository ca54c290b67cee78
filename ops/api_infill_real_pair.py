"""llama-server's ``/infill`` on the real pair, as editors' completion plugins send it (llama.vim's
body: its sampler chain, ``input_extra`` files, ``n_indent``, ``response_fields``; here top-k 1,
so that answers have an oracle), beside llama-server itself.

1. ``honcho start`` of the repository's Procfile and .env (the default preset, free ports, the
   n-gram cache off so that a gap asked again is not answered from its first answer): each
   gap's answer, whole and streamed, against the fleet target's own plain greedy decoding
   (int8 as the worker runs it, one token a round) of llama-server's prompt layout written out
   here (repository tokens, the files, the FIM prompt), cut where ``n_indent`` ends it.
2. With ``--llama-server-bin DIR``: ``llama-server`` on the target's GGUF (``specsplit models
   pull --keep``), 2 threads, ``--no-repack`` (its AMX path crashes here), alone and with the draft's GGUF (``-md``: its own speculative
   decoding), the same bodies. Each gap is timed ``--repeats`` times each way, alternating
   (both keep their prompt caches: from the second run a gap's prompt is cached everywhere).

    python ops/api_infill_real_pair.py --llama-server-bin "$(../shared/tools/build-llamacpp.sh | tail -n1)" \\
        --json ops/results/api-infill-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_fim_real_pair import GAPS
from ops.api_fixed_length_real_pair import decoding
from ops.api_real_pair import check, new_report, report_checks, served_fleet
from ops.api_structured_real_pair import Reference

# a file of the project the editor has seen (llama.vim's ring buffer of chunks)
UTILS = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n"
FILES = [("utils.py", UTILS)]
FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n", "timings/predicted_ms",
          "truncated", "tokens_cached"]


def vim_body(before: str, after: str, n_predict: int) -> dict:
    """llama.vim's request (its defaults; top-k 1 for an oracle), the cursor's line's indent."""
    line = before.rsplit("\n", 1)[-1]
    return {"id_slot": 0, "input_prefix": before[:len(before) - len(line)], "input_suffix": after, "prompt": line,
            "input_extra": [{"filename": f, "text": t} for f, t in FILES], "n_predict": n_predict,
            "n_indent": len(line) - len(line.lstrip(" ")), "top_k": 1, "top_p": 0.99,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 0, "response_fields": FIELDS}


def layout(tok, body: dict) -> list[int]:
    """llama-server's /infill prompt for Qwen2.5-Coder, written out (all of it fits here)."""
    pre, suf, mid, repo, sep = tok.ids_of([*tok.fim, *tok.fim_repo])
    plain = tok.encode_plain
    ids = [repo, *plain("myproject\n")]
    for f in body["input_extra"]:
        ids += [sep, *plain(f["filename"] + "\n"), *plain(f["text"])]
    return ids + [sep, *plain("filename\n"), pre, *plain(body["input_prefix"]), *tok.encode_text(body["prompt"]),
                  suf, *plain(body["input_suffix"]), mid]


def indent_cut(text: str, n: int) -> str:
    """Where ``n_indent`` ends ``text`` (a line after the first indented by fewer than n)."""
    if n <= 0:
        return text
    lines, at = text.split("\n"), 0
    at = len(lines[0]) + 1
    for k, line in enumerate(lines[1:], 1):
        ws = len(line) - len(line.lstrip(" \t"))
        if ws < n and (ws < len(line) or k < len(lines) - 1):
            return text[:at + ws]
        at += len(line) + 1
    return text


@contextlib.contextmanager
def llama_server(bin_dir: Path, model: Path, draft: Path | None, threads: int, log: Path, repack: bool = False):
    """``llama-server`` on a free port (as people run it: no OMP_WAIT_POLICY), healthy: its url."""
    from specsplit.launch import free_ports

    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["LD_LIBRARY_PATH"] = str(bin_dir)
    # --no-repack: this build's AMX repacking crashes at the first forward here (SIGSEGV in
    # ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36's llama.cpp on this Xeon)
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-c", "8192", "--port", str(port),
           "--host", "127.0.0.1", "-np", "1", *([] if repack else ["--no-repack"])]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise TimeoutError("llama-server did not serve in time")
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()


def timed(url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    res = httpx.post(f"{url}/infill", json=body, timeout=600).json()
    return {"wall_s": time.perf_counter() - t0, "tokens": res["timings/predicted_n"], "content": res["content"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--llama-server-bin", default=None, help="a llama.cpp build's bin dir with llama-server")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    tok = ServedTokenizer(resolve_model_paths(ModelSettings()).target)
    stops = list(tok.eog_token_ids)  # (llama-server's ends of generation)
    report = new_report(max_new_tokens=args.max_new_tokens, files=FILES)
    bodies = [vim_body(before, after, args.max_new_tokens) for before, after in GAPS]
    with served_fleet("specsplit-api-infill-", report, SPECSPLIT_LOOKUP_CACHE_KEYS="0") as (url, _, tmp):
        ref = Reference()
        answers = []
        for i, body in enumerate(bodies):
            ids = layout(tok, body)
            full = tok.decode(decoding(ref, ids, args.max_new_tokens, f"infill-{i}", stops, 0))
            want = indent_cut(full, body["n_indent"])
            res = httpx.post(f"{url}/infill", json=body, timeout=600).json()
            whole = httpx.post(f"{url}/infill", json={**body, "response_fields": None}, timeout=600).json()
            check(report, f"gap {i}: the answer = the target's decoding of llama-server's layout, cut at n_indent",
                  res["content"] == want and whole["tokens_evaluated"] == len(ids), prompt_tokens=len(ids),
                  n_indent=body["n_indent"], stop_type=whole["stop_type"], answer=res["content"],
                  cut=want != full)
            with httpx.stream("POST", f"{url}/infill", json={**body, "stream": True}, timeout=600) as r:
                chunks = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines() if ln]
            check(report, f"gap {i}: streamed = whole", "".join(c["content"] for c in chunks) == res["content"])
            answers.append(res["content"])
            print(f"--- gap {i} ---\n{GAPS[i][0]}\033[1m{res['content']}\033[0m{GAPS[i][1]}", flush=True)
        del ref
        ways: dict[str, str] = {"specsplit": url}
        runs: dict[str, list[list[dict]]] = {}
        stack = contextlib.ExitStack()
        with stack:
            if args.llama_server_bin:
                from specsplit.bench.llamacpp import kept_gguf
                from specsplit.models import ModelSettings as MS

                bin_dir = Path(args.llama_server_bin).expanduser()
                target = kept_gguf(MS())
                draft = target.parents[1] / resolve_model_paths(MS()).draft.name / \
                    f"{resolve_model_paths(MS()).draft.name}.gguf"
                ways["llama-server"] = stack.enter_context(llama_server(bin_dir, target, None, 2,
                                                                        tmp / "llama-server.log"))
                if draft.is_file():
                    ways["llama-server -md"] = stack.enter_context(llama_server(bin_dir, target, draft, 2,
                                                                                tmp / "llama-server-md.log"))
            names = list(ways)
            for r in range(args.repeats):
                for i, body in enumerate(bodies):
                    for way in names if (r + i) % 2 == 0 else names[::-1]:
                        runs.setdefault(way, [[] for _ in bodies])[i].append(timed(ways[way], body))
    table = {}
    print(f"\n{'gap':<5}" + "".join(f"{w:>26}" for w in runs))
    for i in range(len(bodies)):
        row = {}
        for way, per_gap in runs.items():
            rs = per_gap[i]
            row[way] = {"wall_s": [round(x["wall_s"], 3) for x in rs], "tokens": [x["tokens"] for x in rs],
                        "tok_s": round(statistics.mean(x["tokens"] / x["wall_s"] for x in rs), 2),
                        "same_answer_as_specsplit": [x["content"] == answers[i] for x in rs]}
        table[f"gap {i}"] = row
        print(f"{i:<5}" + "".join(f"{row[w]['tok_s']:>11.2f} tok/s {statistics.mean(row[w]['wall_s']):>6.2f} s  "
                                  for w in runs))
    report["timings"] = table
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
