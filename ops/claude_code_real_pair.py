"""Claude Code against the real pair: ``claude -p PROMPT`` with ``ANTHROPIC_BASE_URL`` at a fleet
started as the README does (``honcho start``, the repository's .env with the session limit raised
to the model's context, since Claude Code's first request carries ~21,000 tokens of system prompt
and tools). Records Claude Code's JSON result, the wall time, and what the API and the workers
saw (HTTP statuses of /v1/messages: a 499 is a request Claude Code gave up on; prefix-cache hits;
worker requests), to a JSON file.

Needs npm (Claude Code installs from the npm registry into ``--prefix``, ~250 MB) and the real
pair provisioned (``./ops/demo.sh`` once). Several minutes on a 2-core CPU: the first request's
prefill is most of it.

    python ops/claude_code_real_pair.py --json ops/results/FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def scrape(url: str, pattern: str) -> dict[str, float]:
    """The Prometheus samples at ``url`` whose name matches the regular expression ``pattern`` (and more)."""
    text = httpx.get(url, timeout=10).text
    found = re.finditer(rf"^(?P<name>{pattern}\S*) (?P<value>\S+)$", text, re.MULTILINE)
    return {m["name"]: float(m["value"]) for m in found}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default="Reply with one short sentence: what is 2 + 2?")
    p.add_argument("--version", default="2.1.197", help="the @anthropic-ai/claude-code version")
    p.add_argument("--prefix", default=str(Path(tempfile.gettempdir()) / "specsplit-claude-code"))
    p.add_argument("--session-tokens", type=int, default=32768, help="SPECSPLIT_MAX_SESSION_TOKENS for the run")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--max-output-tokens", type=int, default=256, help="CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    p.add_argument("--stream-idle-s", type=float, default=1800,
                   help="CLAUDE_STREAM_IDLE_TIMEOUT_MS / 1000 (0: Claude Code's 300 s, which a long prefill outlasts)")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    prefix = Path(a.prefix)
    claude = prefix / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        if not shutil.which("npm"):
            sys.exit("needs npm to install Claude Code (@anthropic-ai/claude-code)")
        subprocess.run(["npm", "install", "--prefix", str(prefix), f"@anthropic-ai/claude-code@{a.version}"],
                       check=True)
    version = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    env_file = prefix / "fleet.env"
    env_file.write_text((ROOT / ".env").read_text() + f"\nSPECSPLIT_MAX_SESSION_TOKENS={a.session_tokens}\n")
    home, work = prefix / "home", prefix / "work"
    for d in (home, work):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    venv_bin = str(ROOT / ".venv" / "bin")
    fleet_env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "SPECSPLIT_ENV_FILE": str(env_file)}
    log = open(prefix / "fleet.log", "w")
    fleet = subprocess.Popen(["honcho", "start", "-e", str(env_file)], cwd=ROOT, env=fleet_env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {"config": {**vars(a), "claude_code": version, "cpu_count": os.cpu_count()}}
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if fleet.poll() is not None:
                sys.exit(f"the fleet stopped; see {prefix / 'fleet.log'}")
            time.sleep(2)
        model = httpx.get("http://127.0.0.1:8000/v1/models", timeout=10).json()["data"][0]["id"]
        env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": "http://127.0.0.1:8000",
               "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
               "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "API_TIMEOUT_MS": str(int(a.timeout_s * 1000)),
               # its answers are sampled (temperature 1): a small model may ramble to the context's end
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(a.max_output_tokens)}
        if a.stream_idle_s:  # Claude Code gives up on a stream without events for max(this, 300 s)
            env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] = str(int(a.stream_idle_s * 1000))
        t0 = time.monotonic()
        done = subprocess.run([str(claude), "-p", a.prompt, "--output-format", "json"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=a.timeout_s + 60)
        out["wall_s"] = round(time.monotonic() - t0, 1)
        out["returncode"] = done.returncode
        try:
            out["result"] = json.loads(done.stdout)
        except json.JSONDecodeError:
            out["stdout"], out["stderr"] = done.stdout[-2000:], done.stderr[-2000:]
        out["api"] = scrape("http://127.0.0.1:8000/metrics",
                            re.escape('specsplit:http_responses_total{route="/v1/messages"'))
        out["target"] = scrape("http://127.0.0.1:9900/metrics",
                               "specsplit:worker_(?:request_seconds_count|prefix_cache)")
        out["orchestrator"] = scrape("http://127.0.0.1:9700/metrics", "specsplit:sessions_finished_total")
    finally:
        os.killpg(fleet.pid, 15)
        fleet.wait(timeout=120)
        log.close()
    result = out.get("result") or {}
    print(f"Claude Code {version}: rc {out.get('returncode')}, {out.get('wall_s')} s, "
          f"{result.get('subtype')} ({'error' if result.get('is_error') else 'answered'}): "
          f"{str(result.get('result'))[:200]!r}")
    print(f"/v1/messages statuses: {out.get('api')}")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json_path}")


if __name__ == "__main__":
    main()
