"""Push prompts to a running fleet from Python; stream the answers as text, print tok/s.

    SPECSPLIT_PRESET=smollm2 honcho start          # or any running fleet
    python ops/example_client.py "What is 2 + 2?" --orchestrator tcp://127.0.0.1:5570
"""

import argparse
import asyncio

from specsplit.client import SpecSplitClient
from specsplit.models import ModelSettings, resolve_model_paths
from specsplit.produce import PromptCodec


async def main(prompts: list[str], addr: str, max_new_tokens: int) -> None:
    codec = PromptCodec(resolve_model_paths(ModelSettings()).target)  # the fleet's tokenizer (SPECSPLIT_PRESET)
    async with SpecSplitClient(addr) as client:
        if not await client.ping(timeout_s=5.0):
            raise SystemExit(f"no orchestrator answered at {addr}")
        for prompt in prompts:
            print(f"\n>>> {prompt}")
            res = await client.generate(codec.encode(prompt), max_new_tokens=max_new_tokens,
                                        stop_token_ids=codec.stop_token_ids,
                                        on_tokens=lambda ids: print(codec.decode(ids), end="", flush=True))
            print(f"\n[{len(res.token_ids)} tokens, {res.tokens_per_s:.1f} tok/s, "
                  f"{res.mean_accepted:.2f} tokens/round, {res.finish_reason}]")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="+")
    p.add_argument("--orchestrator", default="tcp://127.0.0.1:5570")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    asyncio.run(main(args.prompts, args.orchestrator, args.max_new_tokens))
