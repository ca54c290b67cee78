"""The fleet's default settings as ``honcho start`` gives them: the ``.env`` the ``specsplit``
command already applied (``specsplit.envfile``), or, run from a directory without one, the
repository's (e.g. the int8 kernels of both roles) under whatever the shell sets, so a bench runs
the fleet the operator runs. Parsed by honcho's own parser, as every env file here."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

ENV_FILE = Path(__file__).resolve().parents[2] / ".env"
# set by specsplit.launch.Fleet for each fleet it starts (its own ports, secret and preset)
FLEET_OWNED = ("SPECSPLIT_DRAFT_BACKEND", "SPECSPLIT_TARGET_BACKEND", "SPECSPLIT_ORCHESTRATOR",
               "SPECSPLIT_DRAFT_ROUTER", "SPECSPLIT_TARGET_ROUTER", "SPECSPLIT_METRICS_PORT",
               "SPECSPLIT_METRICS_BIND_PORT", "SPECSPLIT_FLEET_SECRET_FILE", "SPECSPLIT_PRESET")


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as honcho reads them (its parser)."""
    from honcho.environ import parse

    return dict(parse(path.read_text()))


def fleet_defaults(path: str | Path | None = None, environ=None) -> dict[str, str]:
    """The env file's entries the environment does not set (``path`` None: ./.env, which the
    command has applied already, else the repository's; "none" or a missing file: nothing beyond
    what the command applied: ``SPECSPLIT_ENV_FILE=`` keeps it from applying ./.env too)."""
    environ = os.environ if environ is None else environ
    if path is None:
        path = Path(".env") if Path(".env").is_file() else ENV_FILE
    path = Path(path)
    if str(path) == "none" or not path.is_file():
        return {}
    return {k: v for k, v in read_env_file(path).items() if k not in environ}


def fleet_env(defaults: dict[str, str]) -> dict[str, str]:
    """What a launched fleet takes from ``defaults`` (its addresses and secret are its own)."""
    return {k: v for k, v in defaults.items() if k not in FLEET_OWNED}


@contextmanager
def environ_with(defaults: dict[str, str]):
    """Within: ``defaults`` are in os.environ (settings objects built here read them); restored
    afterwards, so nothing leaks into processes started later."""
    added = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
