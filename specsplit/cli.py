"""The ``specsplit`` command: one subcommand per process role, plus tools.

    specsplit router draft|target     a session-hash router (brokers)
    specsplit draft | target          a worker (loads its model)
    specsplit pair                    a draft and a target worker in one process (one GPU)
    specsplit orchestrator            the asyncio orchestrator
    specsplit api                     the OpenAI-compatible HTTP API (127.0.0.1:8000 by default)
    specsplit produce PROMPT...       push prompts, stream answers
    specsplit models pull|path        provision models
    specsplit bench transport|longctx|netem|load|soak|...  benchmarks
    specsplit config [ROLE]           a role's effective settings as JSON (all roles without ROLE)
    specsplit keys new [--dir D] [--name N]  a CURVE keypair (N.key public, N.key_secret mode 0600)

Every command first applies `.env` of the working directory as `honcho start` reads it, its
values over the shell's (specsplit.envfile; SPECSPLIT_ENV_FILE names other files, empty: none).

Each command imports its own stack inside its function (the only imports inside functions here):
the router and the orchestrator never load torch, `--help` loads neither torch nor zmq, and a
worker sets OpenMP's environment before torch loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading

from specsplit.envfile import EnvFileRead, apply_env_file
from specsplit.openmp import WORKER_SPINCOUNT as WORKER_SPINCOUNT  # re-exported: its home was here
from specsplit.openmp import set_wait_policy, set_worker_openmp
from specsplit.supervise import supervise

set_wait_policy()  # before torch is ever imported


def _exit_zero_on_stop_signals() -> None:
    """Before a role installs its own stop handlers, and after it restores them: SIGTERM/SIGINT
    mean "stop now, cleanly" (exit 0). honcho signals the whole process group and the supervisor
    forwards the signal too, so a role may get a second one while it is already exiting."""
    def _exit(signum, frame):
        raise SystemExit(0)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit)


def _ignore_stop_signals() -> None:
    """The role is done and the process exits: a late SIGTERM must not kill it (Python's
    finalization resets handled signals to SIG_DFL, but leaves ignored ones ignored)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


WORKER_ROLES = ("draft", "target", "pair")
# roles whose process ends once the role returned (``_exit_now``): the workers (their teardown), and
# the orchestrator, whose ZeroMQ context, torn down at exit after its sockets closed with requests
# in flight, once aborted in libzmq's session cleanup (an EAGAIN assertion, src/session_base.cpp)
EXIT_NOW_ROLES = (*WORKER_ROLES, "orchestrator")


def _exit_now(rc: int) -> None:
    """End the process of a role in EXIT_NOW_ROLES once it returned (and a supervisor's once its
    child exited): its drain is done, its sockets closed and its logs written, and what the interpreter's own
    teardown would add (a full garbage collection of torch's and transformers' objects, torch's
    operator registry undone) is about a second of CPU a worker (docs/results.md), which on a busy
    box outlasts honcho's 5 s between SIGTERM and SIGKILL when a whole fleet stops at once.
    Flushed first: nothing logged is lost."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken pipe: nothing more can reach it
    logging.shutdown()
    os._exit(rc)


def _role(cmd: str, rest: list[str]) -> int:
    if cmd == "router":
        from brokers.__main__ import main as router_main  # each role loads its own stack only

        return router_main(rest)
    if cmd in WORKER_ROLES:
        return _worker(cmd, rest)
    if cmd == "api":
        from specsplit.api.run import api_main  # each role loads its own stack only

        return api_main(rest)
    return _orchestrator(rest)


ROLE_HELP = {
    "draft": "A draft worker: loads the draft model and proposes token trees for the sessions its router sends.",
    "target": "A target worker: loads the target model, keeps each session's KV cache, verifies trees.",
    "pair": "A draft and a target worker in one process, each with its own compute thread, router connection, "
            "metrics port and (CUDA) stream: on one GPU, the draft's growth then runs beside the target's verify "
            "instead of taking turns with it (two processes' kernels do; docs/hardware.md).",
    "orchestrator": "The orchestrator: runs the draft -> verify rounds of every session on one asyncio loop; "
                    "producers and the HTTP API connect to it.",
}


def _role_usage(cmd: str, rest: list[str]) -> int:
    """``specsplit ROLE --help``: usage, and every setting's name and default, without starting
    anything (a role takes no arguments besides the router's; settings come from the environment)."""
    if cmd == "router":
        from brokers.__main__ import _parse  # the role's stack, for its usage only

        _parse([*rest])  # argparse prints the usage (or the error) and exits
        return 0
    if cmd == "api":
        from specsplit.api.run import api_main  # the role's stack, for its usage only

        return api_main(rest)
    p = argparse.ArgumentParser(
        prog=f"specsplit {cmd}", description=ROLE_HELP[cmd], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Configured by SPECSPLIT_* environment variables and .env in the working directory (read as honcho "
               "reads it, its values over the shell's; SPECSPLIT_ENV_FILE names other files); "
               f"`specsplit config {cmd}` prints the effective settings, docs/configuration.md lists them all. "
               "Runs supervised: restarted on a crash, stopped cleanly by SIGTERM.")
    p.parse_args(rest)
    return 0


def _worker(service: str, argv: list[str]) -> int:
    set_worker_openmp()  # libgomp reads it once, as torch loads it
    # the worker's stack, loaded after OpenMP's environment is set
    from brokers.settings import MetricsSettings
    from specsplit.config import WorkerSettings
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings
    from specsplit import workers

    settings = WorkerSettings()
    configure_logging(settings.log_level, settings.log_json)
    if service == "pair":
        return workers.run_pair(settings, ModelSettings(), MetricsSettings())
    return workers.run_worker(service, settings, ModelSettings(), MetricsSettings())


def _orchestrator(argv: list[str]) -> int:
    # each role loads its own stack only (the orchestrator's: zmq, never torch)
    from pydantic import ValidationError

    from brokers.curve import CurveError
    from brokers.settings import MetricsSettings
    from specsplit.config import OrchestratorSettings
    from specsplit.logs import configure_logging, get_logger
    from specsplit.metrics import count_restarts, serve_metrics
    from specsplit.orchestrator.server import Orchestrator

    try:
        settings, metrics = OrchestratorSettings(), MetricsSettings()
        settings.curve_keys(server=True, client=True)  # unreadable or unsafe key files: refused now
    except (ValidationError, CurveError) as exc:
        print(f"invalid orchestrator settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum, frame) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(stop.set)

        orchestrator = Orchestrator(settings)
        count_restarts(orchestrator.metrics.registry, metrics)
        serve_metrics(orchestrator.metrics.registry, metrics, "orchestrator", get_logger("specsplit.orchestrator"))
        # process-level handlers, restored afterwards (asyncio's add_signal_handler would leave
        # SIG_DFL behind, and a second SIGTERM, e.g. honcho's and the supervisor's, would kill us)
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            await orchestrator.run(stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    asyncio.run(main())
    return 0


def _bench(argv: list[str]) -> int:
    # each command loads its own stack only (a benchmark's: torch, for most)
    if argv and argv[0] == "transport":
        from specsplit.bench.transport import main

        return main(argv[1:])
    if argv and argv[0] == "netem":
        from specsplit.bench.netem import main

        return main(argv[1:])
    if argv and argv[0] == "longctx":
        from specsplit.bench.longctx import main

        return main(argv[1:])
    if argv and argv[0] == "soak":
        from specsplit.bench.soak import main

        return main(argv[1:])
    if argv and argv[0] == "gpu":
        from specsplit.bench.gpu import main

        return main(argv[1:])
    if argv and argv[0] == "costreplay":
        from specsplit.orchestrator.replay import main

        return main(argv[1:])
    if argv and argv[0] == "replay":
        from specsplit.bench.replay import main

        return main(argv[1:])
    if argv and argv[0] == "growth":
        from specsplit.bench.growth import main

        return main(argv[1:])
    from specsplit.bench import require_bench_extras

    if argv and argv[0] == "load":
        from specsplit.bench.load import main

        require_bench_extras()
        return main(argv[1:])
    if argv and argv[0] == "api":
        from specsplit.bench.api import main

        require_bench_extras()
        return main(argv[1:])
    if argv and argv[0] == "chat":
        from specsplit.bench.chat import main

        require_bench_extras()
        return main(argv[1:])
    from specsplit.bench.quality import main as bench_main

    require_bench_extras()
    return bench_main(argv)


def _config(argv: list[str], env_file: EnvFileRead | None) -> int:
    from specsplit.effective import ROLES, effective_settings  # zmq (brokers.curve): not for `specsplit --help`

    if argv[:1] in (["-h"], ["--help"]):
        print("usage: specsplit config [ROLE ...]         each ROLE's effective settings as JSON (all without ROLE)\n"
              "       specsplit config --markdown [PATH]  every setting as Markdown, printed or written to PATH\n"
              "                                           (docs/configuration.md is its output)")
        return 0
    if argv[:1] == ["--markdown"]:
        from specsplit.configdoc import main  # each command loads its own stack only

        if len(argv) > 2:
            print("usage: specsplit config --markdown [PATH]", file=sys.stderr)
            return 2
        return main(argv[1] if len(argv) == 2 else None)
    roles = argv or list(ROLES)
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        print(f"specsplit config: unknown role {unknown[0]!r}; roles: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    out = effective_settings(roles[0]) if len(roles) == 1 else {r: effective_settings(r) for r in roles}
    print(json.dumps(out, indent=2, sort_keys=True))
    if env_file is not None:  # where the values came from, beside the JSON
        print(env_file.describe(), file=sys.stderr)
    return 0


def _keys(argv: list[str]) -> int:
    from brokers.curve import CurveError, write_keypair  # zmq: not for `specsplit --help`

    p = argparse.ArgumentParser(prog="specsplit keys", description="CURVE keys for off-box fleets.")
    sub = p.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="write NAME.key (public) and NAME.key_secret (mode 0600) in DIR")
    new.add_argument("--dir", default=".", help="directory (created 0700 if missing; default: .)")
    new.add_argument("--name", default="specsplit", help="file name stem (default: specsplit)")
    args = p.parse_args(argv)
    try:
        public, secret = write_keypair(args.dir, args.name)
    except (CurveError, OSError) as exc:
        print(f"specsplit keys: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; give it to this process only: "
          f"SPECSPLIT_CURVE_SECRET_KEY_FILE={secret})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``specsplit`` command. As the process's command (``argv`` None: the console script,
    ``python -m specsplit``) it applies the env file before any setting is read, so every role and
    tool sees what ``honcho start`` would give it; a caller passing ``argv`` in-process (a test)
    keeps its own environment untouched."""
    as_command = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    env_file = apply_env_file() if as_command else None
    cmd, rest = argv[0], argv[1:]
    from specsplit.config import SupervisorSettings, check_removed_settings  # zmq: not for `specsplit --help`

    check_removed_settings()
    if cmd in ("router", "draft", "target", "pair", "orchestrator", "api"):
        if "-h" in rest or "--help" in rest or (cmd != "router" and rest):
            return _role_usage(cmd, rest)  # usage (or a usage error): nothing supervised, nothing started
        rc = supervise(argv, SupervisorSettings())  # None: this process is the supervised child (or unsupervised)
        if rc is not None:
            if as_command:
                _exit_now(rc)  # the supervisor's child has exited: nothing is left to tear down
            return rc
        _exit_zero_on_stop_signals()
        try:
            rc = _role(cmd, rest)
        finally:
            _ignore_stop_signals()
        if as_command and cmd in EXIT_NOW_ROLES:
            _exit_now(rc)
        return rc
    if cmd == "produce":
        from specsplit.produce import produce_main  # each command loads its own stack only

        return produce_main(rest)
    if cmd == "models":
        from specsplit.models import models_main  # each command loads its own stack only

        return models_main(rest)
    if cmd == "bench":
        return _bench(rest)
    if cmd == "config":
        return _config(rest, env_file)
    if cmd == "keys":
        return _keys(rest)
    print(f"specsplit: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
