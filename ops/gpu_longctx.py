"""SpecPV on an accelerator: what a verification round costs against the partial view and against
the whole cache at long contexts, through the loop ``specsplit bench longctx`` runs (the same
``measure``: ``specsplit.local.generate`` over the workers' engines, full / approximate / exact
one after another on one prompt, the prefill shared), with random weights of the real
architectures (``--target-config`` / ``--draft-config``: directories holding a ``config.json``,
e.g. the pulled models'; only those travel to a device machine, and timings do not depend on the
values). The figures that mean something are the verify ms per round, partial and full rounds
apart, as a function of the context; random weights accept few drafted tokens, so the rows' tokens
per round and tok/s are recorded but say nothing about the real pair. Every other option is
``specsplit bench longctx``'s (its SpecPV budget, tree, modes, contexts, ``--max-new-tokens``).
Prints the bench's table and writes JSON with --json after every context.

    python ops/gpu_longctx.py --device cuda --target-config DIR --draft-config DIR \\
        --contexts 4096,16384,32768 --max-new-tokens 64 --tree 16,3,4 --json FILE
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from gpu_cost import build  # (ops/ is the script's directory)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target-config", required=True)
    p.add_argument("--draft-config", required=True)
    p.add_argument("--attention", choices=("grouped", "sdpa"), default="grouped",
                   help="CUDA: decode steps and trees through grouped matmuls (the workers' default) or sdpa")
    p.add_argument("--value-chunk", type=int, default=None,
                   help="grouped attention: keys per chunk of probabilities x values (0: one matmul; "
                        "default: specsplit.models.attention.ACCEL_VALUE_CHUNK)")
    own, rest = p.parse_known_args()
    if own.value_chunk is not None:
        from specsplit.models import attention

        attention.ACCEL_VALUE_CHUNK = own.value_chunk

    from specsplit.backends import build_backend
    from specsplit.bench import longctx
    from specsplit.logs import configure_logging
    from specsplit.workers import WorkerSettings

    args = longctx.parse(rest)
    contexts, modes, spec, window = longctx.settle(args)
    configure_logging("WARNING")
    target = build(own.target_config, own.device, own.dtype)
    draft = build(own.draft_config, own.device, own.dtype)
    settings = WorkerSettings(cuda_grouped_attention=own.attention == "grouped")
    backends = {role: build_backend(role, own.device, settings) for role in ("draft", "target")}
    target, draft = backends["target"].prepare(target), backends["draft"].prepare(draft)  # as a worker does
    rng = random.Random(0)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    ids = [rng.randrange(vocab) for _ in range(max(contexts))]
    prompts = {c: ids[-c:] for c in contexts}
    name = torch.cuda.get_device_name() if own.device.startswith("cuda") else own.device
    out = {"device": own.device, "name": name, "dtype": own.dtype, "torch": torch.__version__,
           "backend": backends["target"].describe(), "value_chunk": own.value_chunk,
           "weights": "random (the configs' architectures): verify ms are the figures; tokens per round and tok/s "
                      "are not the real pair's",
           "config": {k: v for k, v in vars(args).items() if k != "tree_spec"} | {"spec": spec.model_dump()},
           "target_config": target.config.to_diff_dict(), "draft_config": draft.config.to_diff_dict(), "rows": []}
    for c in longctx.measure(draft, target, prompts, modes, args, spec, window, out["rows"], backends):
        out["summary"] = longctx.summarize(out["rows"], contexts, spec.threshold)
        out["complete"] = c == contexts[-1]
        if args.json_path:  # after every context: a run stopped at its time limit keeps what it measured
            with open(args.json_path, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        print(longctx.table([r for r in out["rows"] if r["context"] == c]), flush=True)
    print(f"\n{name}, {own.dtype}, random weights\n" + longctx.table(out["rows"]))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    sys.exit(main())
