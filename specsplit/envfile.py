"""The env file every ``specsplit`` command applies first, read as ``honcho start`` reads ``.env``,
so a setting has one meaning under honcho and in a plain shell.

honcho 2 (``honcho.command._read_env``) reads ``-e FILE[,FILE]`` (default ``.env``) under ``-d DIR``
(default: the working directory), skips a file it cannot open, and starts each process with the
shell's environment and the files' values over it. Its parser, ``honcho.environ.parse``, reused
here, splits each line with ``shlex``: ``A="x y"`` is ``x y``, ``A=x y`` is ``xy``, ``#`` starts a
comment even inside a word (``A=x#y`` is ``x``), ``export A=1`` and ``A=`` are skipped, nothing
is expanded, and a quoted ``\\n`` or ``\\t`` becomes a newline or a tab. The command does the same:

- files: ``SPECSPLIT_ENV_FILE`` (comma-separated like ``-e``, relative to the working directory;
  empty: none), else ``.env``;
- the files' values win over the shell's, as under honcho: ``SPECSPLIT_X=a specsplit target`` runs
  what ``SPECSPLIT_X=a honcho start`` starts. To override a file's value, name another file;
- once per process tree. A process started by ``honcho start`` (``HONCHO_PROCESS_NAME`` is set)
  already has honcho's files, under its ``-e``/``-d`` and its Procfile line's own assignments, so it
  reads none unless ``SPECSPLIT_ENV_FILE`` names some. A command that applied its files sets
  ``SPECSPLIT_ENV_FILE`` empty, so what it starts (its supervised child, a bench's fleet) inherits
  those values, and the overrides it adds, instead of reading them again. ``honcho run`` marks
  nothing: ``honcho run -e F specsplit ...`` needs ``SPECSPLIT_ENV_FILE=F`` too.

Stdlib and honcho only: ``specsplit.cli`` applies it before anything reads a setting.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from honcho.environ import parse as honcho_parse

ENV_FILE_VAR = "SPECSPLIT_ENV_FILE"
DEFAULT_ENV_FILE = ".env"
HONCHO_MARKER = "HONCHO_PROCESS_NAME"  # honcho start sets it in each process it starts ("target.1")


@dataclass(frozen=True)
class EnvFileRead:
    """What ``apply_env_file`` did: the files it read, the values they set, the shell values those
    replaced, or why it read none."""

    files: tuple[Path, ...] = ()
    values: dict[str, str] = field(default_factory=dict)
    replaced: tuple[str, ...] = ()  # names whose different shell value the files' value replaced
    skipped: str = ""  # why no file was read ("" when some was)

    def describe(self) -> str:
        """One line for ``specsplit config``: where the environment's values came from."""
        if not self.files:
            return f"env file: none read ({self.skipped}); settings come from the environment and defaults"
        names = ", ".join(sorted(self.values)) or "nothing"
        over = f"; over the shell's {', '.join(self.replaced)}" if self.replaced else ""
        return f"env file: {', '.join(map(str, self.files))} set {names}{over}; the rest: the shell and defaults"


def env_file_names(environ) -> list[str]:
    """The files this process reads: SPECSPLIT_ENV_FILE's, else ``.env``, or none in a process
    that ``honcho start`` started. ``{"SPECSPLIT_ENV_FILE": "a.env, b.env"}`` -> ["a.env", "b.env"]."""
    given = environ.get(ENV_FILE_VAR)
    if given is None:
        return [] if HONCHO_MARKER in environ else [DEFAULT_ENV_FILE]
    return [name.strip() for name in given.split(",") if name.strip()]


def read_env_files(names: list[str], cwd: Path) -> tuple[tuple[Path, ...], dict[str, str]]:
    """The files under ``cwd`` that could be read, and their values as honcho parses them (later
    files win); honcho's ``_read_env``, which joins the files' text and parses it once."""
    files, texts = [], []
    for name in names:
        path = cwd / Path(name).expanduser()
        try:
            texts.append(path.read_text())
        except UnicodeDecodeError as exc:
            raise SystemExit(f"specsplit: {path}: not text ({exc.reason}); an env file holds KEY=VALUE lines") from None
        except OSError:  # honcho skips a missing or unreadable file too
            continue
        files.append(path.absolute())
    return tuple(files), honcho_parse("\n".join(texts))


def apply_env_file(environ: MutableMapping[str, str] | None = None, cwd: Path | None = None) -> EnvFileRead:
    """Put the env files' values into ``environ`` (os.environ by default) over what it holds, then
    set SPECSPLIT_ENV_FILE empty there so that the processes this one starts read none again."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else Path(cwd)
    names = env_file_names(environ)
    files, values = read_env_files(names, cwd)
    replaced = tuple(sorted(k for k, v in values.items() if k in environ and environ[k] != v))
    if files:
        skipped = ""
    elif names:
        skipped = f"no {', '.join(names)} in {cwd}"
    elif ENV_FILE_VAR in environ:
        skipped = f"{ENV_FILE_VAR} is empty: set so, or by the specsplit command that started this one"
    else:
        skipped = "honcho start gave this process its env files' values"
    environ.update(values)
    environ[ENV_FILE_VAR] = ""
    return EnvFileRead(files, values, replaced, skipped)
