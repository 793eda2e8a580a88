"""Time-to-answer of `needlescope serve --prefix-cache-mib M`, cold (a prefix never seen) vs warm
(the same prompt again), at the oracle set's needle lengths.

    needlescope serve --model organism --prefix-cache-mib 64 --port 8000 &
    PYTHONPATH=src python bench/serve_prefix_cache.py --base-url http://127.0.0.1:8000/v1 --rounds 3

Each round prefixes every prompt with a fresh nonce, so the cold send shares no prefix with
anything before it; the warm send repeats it. Prints the median latency of each and the
cached_tokens the server reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import openai

from needlescope.run.oracle import load_prompt_set


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="organism")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none")
    prompts = [q for q in load_prompt_set().prompts if q["category"] in ("needle", "long_prefill")]
    for q in prompts:
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        cached = {}
        for _ in range(args.rounds):
            nonce = str(uuid.uuid4().int % 10**6).zfill(6)
            text = (
                q["prompt"].replace("<|user|>", f"<|user|>{nonce}. ", 1)
                if "<|user|>" in q["prompt"]
                else nonce + ". " + q["prompt"]
            )
            for arm in ("cold", "warm"):
                t0 = time.perf_counter()
                r = client.completions.create(model=args.model, prompt=text, max_tokens=4, temperature=0)
                times[arm].append(time.perf_counter() - t0)
                cached[arm] = (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)
        print(
            f"{q['id']:28s} prompt {cached['cold'][0]:5d}  cold {statistics.median(times['cold']):6.3f} s "
            f"(cached {cached['cold'][1]})  warm {statistics.median(times['warm']):6.3f} s (cached {cached['warm'][1]})"
        )


if __name__ == "__main__":
    main()
