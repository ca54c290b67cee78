"""Constrained decoding's speed on the real pair: two default fleets side by side (``honcho
start``), "with" this checkout's code and "without" one thing, the same constrained requests
through the ``openai`` client to each in turn (the first fleet alternating), greedy. ``--tasks``:
``json`` (four JSON-schema answers, ``response_format``), ``vllm`` (vLLM's structured outputs: a
list, dates and a CSV held to regular expressions, a SQL query to a GBNF grammar) or ``all``.
``--versus``: ``grammar-proposer`` (the second fleet runs SPECSPLIT_PROPOSERS=draft,lookup,ngrams)
or ``draft-grammar`` (the first runs SPECSPLIT_DRAFT_GRAMMAR=true, the second false: the draft
proposes unconstrained); ``--setting K=V`` for both fleets; with
``--ref-source DIR``, the code of DIR (a worktree of another commit: ``git worktree add
/tmp/before COMMIT``) with the same settings. Prints per request the tokens, seconds and tokens a
round of each, and writes JSON; exit 1 unless every answer is the same from both (what either
proposes is verified like any node).

    python ops/grammar_chains_ab.py --json ops/results/grammar-chains-ab-qwen-coder.json
    python ops/grammar_chains_ab.py --tasks all --versus draft-grammar --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_real_pair import start_fleet, stop_fleet, wait_health

ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "name": {"type": "string"},
                                         "quantity": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "name", "quantity", "price"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}, "languages": {
                                               "type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "email", "languages"], "additionalProperties": False}
TASKS = [
    ("An inventory of four items in a hardware store.", {"type": "object", "properties": {
        "items": {"type": "array", "items": ITEM, "minItems": 4, "maxItems": 4}}, "required": ["items"],
        "additionalProperties": False}),
    ("Three fictional software engineers.", {"type": "object", "properties": {
        "people": {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}}, "required": ["people"],
        "additionalProperties": False}),
    ("A Python package's metadata.", {"type": "object", "properties": {
        "name": {"type": "string"}, "version": {"type": "string"}, "description": {"type": "string"},
        "license": {"enum": ["MIT", "Apache-2.0", "BSD-3-Clause"]}, "python_requires": {"type": "string"},
        "dependencies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "version", "description", "license", "python_requires", "dependencies"],
        "additionalProperties": False}),
    ("The weather in four European capitals.", {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "integer"},
                                         "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["city", "temperature_c", "sky"], "additionalProperties": False}}),
]


DATE = r"2024-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SQL = r"""root ::= "SELECT " cols " FROM " ident where? order? ";"
cols ::= ident (", " ident)*
ident ::= [a-z_]+
where ::= " WHERE " ident " " op " " value
op ::= ">" | "<" | "=" | ">=" | "<="
value ::= [0-9]+ | "'" [A-Za-z ]* "'"
order ::= " ORDER BY " ident (" ASC" | " DESC")?"""
VLLM_TASKS = [
    ("List ten US states, one per line, each line '- Name'.",
     {"structured_outputs": {"regex": r"(- [A-Z][a-z]+( [A-Z][a-z]+)?\n){10}"}}),
    ("Give eight dates in 2024 for team meetings, as YYYY-MM-DD, comma-separated.",
     {"structured_outputs": {"regex": f"{DATE}(, {DATE}){{7}}"}}),
    ("A CSV with the header name,age,city and six rows of fictional people.",
     {"structured_outputs": {"regex": r"name,age,city\n([A-Z][a-z]+,[1-9][0-9],[A-Z][a-z]+\n){6}"}}),
    ("Write a SQL query for the names and emails of users older than 30 in the users table, by name.",
     {"structured_outputs": {"grammar": SQL}}),
]


def json_task(prompt: str, schema: dict) -> tuple[str, dict]:
    return f"{prompt} Answer in JSON.", {
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


def ask(client, model: str, prompt: str, constraint: dict, max_new: int) -> dict:
    t0 = time.perf_counter()
    rf = constraint.get("response_format")
    extra = {k: v for k, v in constraint.items() if k != "response_format"}
    res = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_new, temperature=0,
        **({"response_format": rf} if rf else {}), **({"extra_body": extra} if extra else {}))
    wall = time.perf_counter() - t0
    spec = res.choices[0].model_extra.get("speculative") or {}
    return {"text": res.choices[0].message.content, "tokens": res.usage.completion_tokens, "wall_s": wall,
            "rounds": spec.get("rounds"), "tokens_per_round": spec.get("mean_accepted_length"),
            "finish": res.choices[0].finish_reason}


def round_summary(log: Path) -> dict:
    """A fleet's rounds from its orchestrator's ``round_done`` lines: how many, tokens accepted a
    round, and for the rounds the draft worker drafted (not re-rooted locally) its ms and nodes."""
    rows = [dict(re.findall(r"(\w+)=([-\d.]+)", line)) for line in log.read_text(errors="replace").splitlines()
            if "round_done" in line]
    drafted = [r for r in rows if float(r.get("draft_ms", 0)) > 0]

    def mean(rs, key):
        return sum(float(r.get(key, 0)) for r in rs) / max(1, len(rs))

    return {"rounds": len(rows), "accepted": mean(rows, "accepted"), "drafted_rounds": len(drafted),
            "draft_ms": mean(drafted, "draft_ms"), "drafted": mean(drafted, "drafted")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--ref-source", default=None, help="the second fleet runs this checkout's code (same settings)")
    p.add_argument("--tasks", choices=["json", "vllm", "all"], default="json")
    p.add_argument("--versus", choices=["grammar-proposer", "draft-grammar"], default="grammar-proposer",
                   help="what the second fleet goes without (ignored with --ref-source)")
    p.add_argument("--setting", action="append", default=[], metavar="SPECSPLIT_X=V",
                   help="a setting for both fleets (repeatable)")
    args = p.parse_args(argv)
    tasks = ([json_task(p_, s_) for p_, s_ in TASKS] if args.tasks in ("json", "all") else []) + \
        (VLLM_TASKS if args.tasks in ("vllm", "all") else [])
    from openai import OpenAI

    tmp = Path(tempfile.mkdtemp(prefix="specsplit-grammar-ab-"))
    fleets = {}
    try:
        ref = Path(args.ref_source).resolve() if args.ref_source else None
        both = dict(kv.split("=", 1) for kv in args.setting)
        with_ = {**both, "SPECSPLIT_DRAFT_GRAMMAR": "true"} if args.versus == "draft-grammar" and not ref else both
        without = {"repo": ref, **both} if ref else {**both, "SPECSPLIT_PROPOSERS": "draft,lookup,ngrams"} \
            if args.versus == "grammar-proposer" else {**both, "SPECSPLIT_DRAFT_GRAMMAR": "false"}
        for name, settings in (("with", with_), ("without", without)):
            (tmp / name).mkdir()
            fleets[name] = start_fleet(tmp / name, **settings)
        clients = {}
        for name, (proc, url) in fleets.items():
            wait_health(url, proc)
            clients[name] = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
        model = httpx.get(f"{fleets['with'][1]}/v1/models", timeout=10).json()["data"][0]["id"]
        for name, client in clients.items():  # the first grammar builds the workers' grammar tokenizers
            ask(client, model, *json_task(TASKS[0][0], {"type": "object"}), 1)
        rows = []
        for i, (prompt, constraint) in enumerate(tasks):
            order = ["with", "without"] if i % 2 == 0 else ["without", "with"]
            row = {"task": prompt, **{name: ask(clients[name], model, prompt, constraint, args.max_new_tokens)
                                      for name in order}}
            row["identical"] = row["with"]["text"] == row["without"]["text"]
            rows.append(row)
            w, o = row["with"], row["without"]
            print(f"{prompt[:40]:40s} {w['tokens']:4d} tokens  with {w['wall_s']:6.2f} s "
                  f"{w['tokens_per_round']:.2f}/round  without {o['wall_s']:6.2f} s {o['tokens_per_round']:.2f}/round  "
                  f"identical={row['identical']}", flush=True)
    finally:
        for proc, _ in fleets.values():
            stop_fleet(proc)
    total = {name: sum(r[name]["tokens"] for r in rows) / sum(r[name]["wall_s"] for r in rows)
             for name in ("with", "without")}
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "max_new_tokens": args.max_new_tokens, "rows": rows,
              "without": f"the code of {args.ref_source}" if args.ref_source else
              "SPECSPLIT_PROPOSERS=draft,lookup,ngrams" if args.versus == "grammar-proposer" else
              "SPECSPLIT_DRAFT_GRAMMAR=false", "tasks": args.tasks,
              "tok_s": total, "speedup": total["with"] / total["without"],
              "identical": sum(r["identical"] for r in rows),
              "rounds": {name: round_summary(tmp / name / "fleet.log") for name in ("with", "without")}}
    print(f"tok/s with {total['with']:.2f}, without {total['without']:.2f}: {report['speedup']:.3f}x; "
          f"identical {report['identical']}/{len(rows)} (fleet logs: {tmp})")
    for name, r in report["rounds"].items():
        print(f"{name:8s} {r['rounds']} rounds, {r['accepted']:.2f} accepted a round; the {r['drafted_rounds']} "
              f"drafted by the worker: {r['draft_ms']:.1f} ms, {r['drafted']:.2f} nodes a round")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["identical"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
