"""Print, one argument a line, the package sources and constraints pip is configured with here,
as uv's flags (ops/setup.sh installs with uv, which reads none of pip's configuration).

    .venv/bin/python ops/pip_sources.py    # e.g. --find-links\n/opt/wheels\n--constraint\n...

Read from `pip config list`: files and PIP_* variables, the variable winning over a file as pip
has it. Passed on: index-url, extra-index-url, find-links, constraint, no-index. Without them uv
would miss what pip finds here (a CPU build of torch on disk, a cap on its version) and take
PyPI's CUDA build instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
RANK = {"global": 0, "install": 1, ":env:": 2}  # later wins: pip's own precedence


def sources(listing: str) -> list[str]:
    """uv's flags for the ``name='value'`` lines `pip config list` prints."""
    best: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or key not in (*FLAGS, "no-index") or section not in RANK:
            continue
        try:
            value = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            continue
        if key not in best or RANK[section] >= best[key][0]:
            best[key] = (RANK[section], value)
    args: list[str] = []
    for key, flag in FLAGS.items():
        for value in best.get(key, (0, ""))[1].split():
            args += [flag, value]
    if best.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    return args


def main() -> int:
    # a failure fails this script: setup then installs with pip rather than uv without pip's sources
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    args = sources(listing)
    if args:
        print("\n".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
