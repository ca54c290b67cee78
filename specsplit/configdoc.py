"""docs/configuration.md, generated from the settings classes: every SPECSPLIT_* variable with its
type, default and meaning, each taken from its one definition (the field and its
``Field(description=...)``).

    specsplit config --markdown                          print it
    specsplit config --markdown docs/configuration.md    write it

Imports only the settings modules (no torch). tests/test_configdoc.py fails when the committed
file differs from what ``render()`` makes now.
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import annotated_types as at
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from brokers.settings import (
    CommonSettings,
    CurveSettings,
    FleetAddresses,
    HeartbeatSettings,
    MetricsSettings,
    RouterSettings,
)
from schemas import SpecPVSpec
from specsplit.api.settings import ApiSettings
from specsplit.config import (
    REMOVED_SETTINGS,
    OrchestratorSettings,
    ProducerSettings,
    SessionLimitSettings,
    SupervisorSettings,
    WorkerSettings,
)
from specsplit.models.settings import ModelSettings

SETTINGS_MODULES = ("brokers.settings", "specsplit.config", "specsplit.api.settings", "specsplit.models.settings")
DOC_PATH = "docs/configuration.md"
COMMAND = f"specsplit config --markdown {DOC_PATH}"

# One section per class, in this order; a section lists the fields its class declares itself.
SECTIONS: tuple[tuple[type[BaseSettings], str], ...] = (
    (CommonSettings, "Logging"),
    (FleetAddresses, "Fleet addresses"),
    (CurveSettings, "CURVE keys"),
    (HeartbeatSettings, "Heartbeats and the fleet secret"),
    (MetricsSettings, "Metrics"),
    (SupervisorSettings, "Supervisor"),
    (RouterSettings, "Routers"),
    (SessionLimitSettings, "Session size"),
    (WorkerSettings, "Workers"),
    (ModelSettings, "Models"),
    (OrchestratorSettings, "Orchestrator"),
    (ProducerSettings, "Producer"),
    (ApiSettings, "HTTP API"),
)

# The settings objects each `specsplit` command builds: a section is read by the commands whose
# objects are (subclasses of) its class.
COMMANDS: dict[str, tuple[type[BaseSettings], ...]] = {
    "router": (RouterSettings, MetricsSettings, SupervisorSettings),
    "draft": (WorkerSettings, ModelSettings, MetricsSettings, SupervisorSettings),
    "target": (WorkerSettings, ModelSettings, MetricsSettings, SupervisorSettings),
    "orchestrator": (OrchestratorSettings, MetricsSettings, SupervisorSettings),
    "api": (ApiSettings, ModelSettings, SupervisorSettings),
    "produce": (ProducerSettings, ModelSettings),
    "models": (ModelSettings,),
}

# An unset SPECSPLIT_SPECPV_* takes SpecPVSpec's default and bounds once SpecPV is on.
FALLBACKS: dict[type[BaseSettings], tuple[str, type]] = {OrchestratorSettings: ("specpv_", SpecPVSpec)}

# SPECSPLIT_* variables that no settings class reads: the env file, tools, tests, an internal marker.
OTHER_VARIABLES: tuple[tuple[str, str], ...] = (
    ("SPECSPLIT_ENV_FILE", ("The env files every `specsplit` command applies first, comma-separated, relative to "
                            "the working directory; empty: none. Unset: `.env`, or none in a process `honcho start` "
                            "started (it has honcho's). A command sets it empty for the processes it starts "
                            "(specsplit.envfile).")),
    ("SPECSPLIT_SUPERVISED_CHILD", "Set by the supervisor in the role it starts (specsplit.supervise); not for users."),
    ("SPECSPLIT_FUZZ_SEED", "Seed of `python -m specsplit.fuzz` and tests/test_fuzz.py (unset: random; 16)."),
    ("SPECSPLIT_FUZZ_COUNT", "Cases of `python -m specsplit.fuzz` and tests/test_fuzz.py (unset: 10000)."),
    ("SPECSPLIT_BENCH_ENGINE", "Default `--engine` of `specsplit bench quality` (unset: torch)."),
    ("SPECSPLIT_LLAMACPP_BIN", "A llama.cpp build's bin directory, for the benchmarks' llamacpp system."),
)

INTRO = f"""\
# Configuration

<!-- Generated from the settings classes by `{COMMAND}`; do not edit by hand. -->

Every SpecSplit process reads its settings from `SPECSPLIT_*` environment variables
(pydantic-settings; names are case-insensitive). `honcho start` and every `specsplit` command also
read `.env` in the working directory, with honcho's parser, and its values win over the shell's:
a setting means the same under honcho and in a plain shell. `SPECSPLIT_ENV_FILE` names other files
(empty: none); a process started by honcho or by a `specsplit` command inherits the values and
reads no file again (specsplit/envfile.py). A variable means the same in every process that reads
it: the addresses, CURVE keys, heartbeats and logging below are set once for the whole fleet.

`specsplit config ROLE` prints the settings a ROLE (router, draft, target, orchestrator, produce,
api) would run with in this environment, with the values derived from them, as JSON, and on stderr
which variables the env file set; `specsplit config` prints every role's. This page is generated
from each setting's definition (`Field(description=...)` in brokers/settings.py,
specsplit/config.py and specsplit/models/settings.py): after changing one, run `{COMMAND}`.

Types: a boolean is `true` or `false` (also `1`/`0`, `yes`/`no`); `unset` means the variable is
not set; durations (`*_S`) are in seconds.
"""


@dataclass(frozen=True)
class Setting:
    """One documented variable."""

    env: str  # SPECSPLIT_...
    kind: str  # type and allowed values, as Markdown
    default: str  # as a user would write it, as Markdown
    description: str


def settings_classes() -> list[type[BaseSettings]]:
    """Every settings class defined in the settings modules (and their subclasses elsewhere)."""
    for name in SETTINGS_MODULES:
        importlib.import_module(name)
    out, todo = [], [BaseSettings]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.split(".")[0] in ("specsplit", "brokers"):
                out.append(sub)
    return out


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The variable that sets ``cls``'s ``field``: SPECSPLIT_ + the field's name (or its alias)."""
    info = cls.model_fields[field]
    alias = info.validation_alias if isinstance(info.validation_alias, str) else None
    return (alias or f"{cls.model_config.get('env_prefix', '')}{field}").upper()


def own_fields(cls: type[BaseSettings]) -> list[str]:
    """The fields ``cls`` declares itself (not inherited), in declaration order."""
    return [name for name in vars(cls).get("__annotations__", {}) if name in cls.model_fields]


def owner(cls: type[BaseSettings], field: str) -> type[BaseSettings]:
    """The class in ``cls``'s MRO that declares ``field``."""
    return next(k for k in cls.__mro__ if field in vars(k).get("__annotations__", {}))


def undocumented() -> list[str]:
    """Problems that ``render`` refuses: classes outside SECTIONS, fields without a description."""
    listed = {cls for cls, _ in SECTIONS}
    problems = []
    for cls in settings_classes():
        for field, info in cls.model_fields.items():
            home = owner(cls, field)
            if home not in listed:
                problems.append(f"{home.__qualname__}.{field}: its class has no section in specsplit.configdoc.SECTIONS")
            elif not (info.description or "").strip():
                problems.append(f"{home.__qualname__}.{field}: no Field(description=...)")
    return sorted(set(problems))


def _bounds(metadata: list) -> list[str]:
    """A field's bounds (``Field(ge=..., le=..., max_length=...)``) as ``≥ 1``, ``at most 256 characters``."""
    out = []
    for item in metadata:
        for kind, attr, mark in ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<")):
            if isinstance(item, kind):
                out.append(f"{mark} {_literal(getattr(item, attr))}")
        if isinstance(item, at.MinLen):
            out.append(f"length ≥ {item.min_length}")
        if isinstance(item, at.MaxLen):
            out.append(f"length ≤ {item.max_length}")
    return out


def _kind(annotation, metadata: list) -> str:
    """The type and allowed values of a field, as a user reads them."""
    if typing.get_origin(annotation) is typing.Annotated:  # a member of a union with its own bounds
        annotation, *infos = typing.get_args(annotation)
        metadata = [m for info in infos for m in getattr(info, "metadata", [info])]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) > 1:  # e.g. a number or `auto`
            return " or ".join(_kind(a, metadata) for a in members)
        annotation = members[0]
    if typing.get_origin(annotation) is typing.Literal:
        values = typing.get_args(annotation)
        return ("one of " if len(values) > 1 else "") + ", ".join(f"`{v}`" for v in values)
    names = {bool: "boolean", int: "integer", float: "number", str: "text", Path: "path", SecretStr: "secret text"}
    base = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return ", ".join([base, *_bounds(metadata)])


def _literal(value) -> str:
    """``value`` as a user writes it in the environment."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _default(value) -> str:
    return "unset" if value is None else f"`{_literal(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def setting(cls: type[BaseSettings], field: str) -> Setting:
    info: FieldInfo = cls.model_fields[field]
    kind, default = _kind(info.annotation, info.metadata), _default(info.get_default(call_default_factory=True))
    prefix, spec = FALLBACKS.get(cls, ("", None))
    if spec is not None and field.startswith(prefix) and field.removeprefix(prefix) in spec.model_fields:
        inner: FieldInfo = spec.model_fields[field.removeprefix(prefix)]
        kind = _kind(inner.annotation, inner.metadata)
        default = f"unset ({spec.__name__}: `{_literal(inner.default)}`)"
    return Setting(env_name(cls, field), kind, default, _cell(info.description or ""))


def sections() -> Iterator[tuple[str, type[BaseSettings], list[Setting]]]:
    for cls, title in SECTIONS:
        yield title, cls, [setting(cls, field) for field in own_fields(cls)]


def _readers(cls: type[BaseSettings]) -> str:
    found = [f"`specsplit {name}`" for name, built in COMMANDS.items() if any(issubclass(b, cls) for b in built)]
    return found[0] if len(found) == 1 else ", ".join(found[:-1]) + " and " + found[-1]


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    return ["| Variable | Type | Default | Meaning |", "|---|---|---|---|",
            *(f"| {' | '.join(row)} |" for row in rows)]


def render() -> str:
    """The whole of docs/configuration.md; ValueError when a setting is undocumented."""
    problems = undocumented()
    if problems:
        raise ValueError("settings without documentation:\n  " + "\n  ".join(problems))
    parts = [INTRO, "## Contents\n"]
    titles = [title for _, title in SECTIONS] + ["Removed variables", "Other variables"]
    parts.append("\n".join(f"- [{t}](#{_anchor(t)})" for t in titles) + "\n")
    for title, cls, rows in sections():
        doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        head = [f"## {title}\n", f"{doc}\n",
                f"Read by {_readers(cls)}; defined in `{cls.__module__}.{cls.__qualname__}`.\n"]
        parts.append("\n".join(head + _table([(f"`{s.env}`", s.kind, s.default, s.description) for s in rows])) + "\n")
    parts.append("\n".join([
        "## Removed variables\n",
        "Setting one of these is refused at startup, with what replaced it (`specsplit.config.REMOVED_SETTINGS`).\n",
        "| Variable | Replaced by |", "|---|---|",
        *(f"| `{name}` | {_cell(why)} |" for name, why in REMOVED_SETTINGS.items())]) + "\n")
    parts.append("\n".join([
        "## Other variables\n",
        "Read outside the settings classes: by the `specsplit` command itself, tools and tests.\n",
        "| Variable | Meaning |", "|---|---|",
        *(f"| `{name}` | {_cell(why)} |" for name, why in OTHER_VARIABLES)]) + "\n")
    return "\n".join(parts)


def documented_names() -> list[str]:
    """Every SPECSPLIT_* name a settings class reads, once each."""
    return sorted({env_name(cls, field) for cls in settings_classes() for field in cls.model_fields})


def main(path: str | None = None) -> int:
    """Print the Markdown, or write it to ``path``."""
    text = render()
    if path is None:
        print(text, end="")
    else:
        Path(path).write_text(text)
        print(f"wrote {path}: {len(documented_names())} settings")
    return 0
