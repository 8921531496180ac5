"""Passkey retrieval through vLLM with eviction: a table of hits per setting.

Each setting starts an offline vLLM engine (CPU, fp32, chunked prefill 512)
on the embedded default model and asks for a 5-digit passkey hidden at several
depths of ~2.9k-token prompts, as a completion and as a chat.

    python benchmarks/needle_retrieval.py                       # the README table
    python benchmarks/needle_retrieval.py --settings full snapkv-end
"""

from __future__ import annotations

import argparse
import json
import time

from vllm_kvevict.evaluation.tasks import needle_prompt

SETTINGS: dict[str, dict | None] = {
    "full": None,
    "streamingllm": {"policy": "streamingllm", "budget": 512},
    "snapkv-per-chunk-k7": {"policy": "snapkv", "budget": 512, "prefill_mode": "per_chunk"},
    "snapkv-end-k7": {"policy": "snapkv", "budget": 512, "prefill_mode": "end_of_prompt"},
    "snapkv-end-k15": {
        "policy": "snapkv", "budget": 512, "prefill_mode": "end_of_prompt",
        "policy_options": {"kernel_size": 15},
    },
}
KEYS = [71432, 28415, 90357, 46208, 13579]
DEPTHS = [0.3, 0.45, 0.5, 0.55, 0.7]


def run_setting(model: str, eviction: dict | None, target_tokens: int) -> tuple[int, int, float]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(
        model, dtype="float32", max_model_len=4096, block_size=32, enforce_eager=True,
        kv_cache_memory_bytes=1 << 28, max_num_batched_tokens=512, enable_prefix_caching=False,
        additional_config={"kv_eviction": eviction} if eviction else {},
    )
    prompts = [needle_prompt(tokenizer, k, target_tokens, d) for k, d in zip(KEYS, DEPTHS)]
    start = time.perf_counter()
    greedy = SamplingParams(max_tokens=24, temperature=0)
    completions = llm.generate(prompts, greedy, use_tqdm=False)
    chats = llm.chat(
        [[{"role": "user", "content": p.removesuffix(" The pass key is")}] for p in prompts],
        greedy, use_tqdm=False,
    )
    elapsed = time.perf_counter() - start
    hits_completion = sum(str(k) in o.outputs[0].text for k, o in zip(KEYS, completions))
    hits_chat = sum(str(k) in o.outputs[0].text for k, o in zip(KEYS, chats))
    llm.llm_engine.engine_core.shutdown()
    return hits_completion, hits_chat, elapsed


def main() -> None:
    from vllm_kvevict.default_model import fetch_default_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--tokens", type=int, default=3000, help="target prompt length")
    args = parser.parse_args()
    model = str(fetch_default_model())
    rows = []
    for name in args.settings:
        completion, chat, seconds = run_setting(model, SETTINGS[name], args.tokens)
        rows.append((name, completion, chat, seconds))
        print(json.dumps({"setting": name, "completion": completion, "chat": chat}), flush=True)
    print("\n| setting | config | completion hits | chat hits | seconds |\n|---|---|---|---|---|")
    for name, completion, chat, seconds in rows:
        config = json.dumps(SETTINGS[name]) if SETTINGS[name] else "no eviction"
        print(f"| {name} | `{config}` | {completion}/{len(KEYS)} | {chat}/{len(KEYS)} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
