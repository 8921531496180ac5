"""How much of the attention output eviction loses, and how much of it
MomentKV's correction gives back, layer by layer, on real prompts.

For each RULER prompt (the default model, 4k tokens) the last 64 prompt
positions are held out as test queries: the context is everything before
them, the selection (AdaKV + SnapKV with kernel 15, or any config) evicts it
down to the budget with the 32 queries before the held-out ones as its
observation window, exactly as at the end of a prompt. For every test query
and query head, over the context keys only:

    f      attention output over the whole context (the full cache)
    f_R    over the kept tokens (standard eviction, Eq. 3 with w_E = 0)
    f_hat  f_R merged with the evicted tokens' closed-form term (MomentKV's
           correction, Eqs. 9, 11, 12; moments from the evicted tokens in fp64)

and reports per layer the mean relative errors ‖f_R - f‖/‖f‖ and
‖f_hat - f‖/‖f‖, the share of (query, head) pairs the correction improves, the
evicted attention mass w_E, the correction's estimate of it ŵ_E (Jensen's lower
bound, Eq. 11) and cos(f_E, f_R) (the paper's Fig. 1b quantities).

    python benchmarks/correction_error.py --samples 8 --fraction 0.2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_kvevict.config import build_config
from vllm_kvevict.eviction.select import KeepRule, choose_kept
from vllm_kvevict.policies.base import ScoringInputs

HELD_OUT = 64
SELECTION = {
    "policy": "snapkv", "sink_tokens": 4, "recent_window": 32, "observation_window": 32,
    "prefill_mode": "end_of_prompt", "policy_options": {"kernel_size": 15, "pooling": "max"},
    "head_budget": "adaptive", "head_budget_floor": 0.2,
}


def layer_errors(keys, values, queries, kept, counts, scale):
    """Per (test query, query head): relative errors of f_R and f_hat, w_E,
    ŵ_E and cos(f_E, f_R). ``keys/values [H, C, D]``, ``queries [Hq, T, D]``."""
    num_kv, context, _ = keys.shape
    group = queries.shape[0] // num_kv
    rows = {name: [] for name in ("err_r", "err_hat", "w_e", "w_e_hat", "cos")}
    for hq in range(queries.shape[0]):
        h = hq // group
        k, v, q = keys[h].double(), values[h].double(), queries[hq].double()
        keep = torch.zeros(context, dtype=torch.bool)
        keep[kept[h, : int(counts[h])]] = True
        logits = q @ k.T * scale  # [T, C]
        weights = torch.softmax(logits, dim=-1)
        f = weights @ v
        w_r = weights[:, keep].sum(-1, keepdim=True)
        f_r = (weights[:, keep] @ v[keep]) / w_r
        f_e = (weights[:, ~keep] @ v[~keep]) / (1 - w_r).clamp(min=1e-300)
        k_e, v_e = k[~keep], v[~keep]
        n_e = k_e.shape[0]
        k_bar, v_bar = k_e.mean(0), v_e.mean(0)
        s_tilde = (v_e - v_bar).T @ (k_e - k_bar)  # Σ (v - v̄)(k - k̄)ᵀ
        log_z_r = torch.logsumexp(logits[:, keep], dim=-1, keepdim=True)
        log_z_e = torch.log(torch.tensor(float(n_e), dtype=torch.float64)) + scale * (q @ k_bar)[:, None]
        f_e_hat = v_bar[None, :] + scale * (q @ s_tilde.T) / n_e  # Eq. 9
        w_e_hat = torch.sigmoid(log_z_e - log_z_r)  # Ẑ_E / (Z_R + Ẑ_E), Eq. 12
        f_hat = (1 - w_e_hat) * f_r + w_e_hat * f_e_hat
        norm = f.norm(dim=-1)
        rows["err_r"].append((f_r - f).norm(dim=-1) / norm)
        rows["err_hat"].append((f_hat - f).norm(dim=-1) / norm)
        rows["w_e"].append(1 - w_r[:, 0])
        rows["w_e_hat"].append(w_e_hat[:, 0])
        rows["cos"].append(torch.nn.functional.cosine_similarity(f_e, f_r, dim=-1))
    return {name: torch.cat(values) for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="RULER prompts (niah tasks in turn)")
    parser.add_argument("--fraction", type=float, default=0.2, help="kept fraction of the context")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()

    from vllm_kvevict.default_model import fetch_default_model
    from vllm_kvevict.evaluation.ruler import RulerGenerator, load_tokenizer
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    model_dir = str(fetch_default_model())
    tokenizer = load_tokenizer(model_dir)
    tasks = ["niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]
    per_task = -(-args.samples // len(tasks))
    samples = RulerGenerator(tokenizer, args.length, 42, "base").samples(tasks, per_task)
    samples = sorted(samples, key=lambda s: s.index)[: args.samples]
    decoder = ReferenceEvictingDecoder(model_dir, None)
    bs = args.block_size
    per_layer: dict[int, list[dict[str, torch.Tensor]]] = {}
    start = time.perf_counter()
    for sample in samples:
        ids = tokenizer(sample.prompt)["input_ids"]
        state = decoder.run_prompt(ids, keep_queries=HELD_OUT + 32)
        context = state.prompt_len - HELD_OUT
        budget = max(64, int(args.fraction * context) // bs * bs)
        config = build_config({**SELECTION, "budget": budget})
        rule = KeepRule.from_config(config)
        frontier = config.schedule(bs, bs).frontier_at_point(context, context)
        for index, store in enumerate(state.layers):
            scale = float(decoder.model.model.layers[index].self_attn.scaling)
            keys, values = store.keys[:, :context], store.values[:, :context]
            inputs = ScoringInputs(
                keys=keys, values=values, key_positions=store.positions[:, :context],
                queries=store.query_history[:, :32], query_positions=store.query_positions[:32],
                scale=scale,
            )
            total_pages = keys.shape[0] * (context // bs - frontier // bs)
            counts, kept = choose_kept(rule, [inputs], [None], context, total_pages, bs)
            per_layer.setdefault(index, []).append(
                layer_errors(keys, values, store.query_history[:, 32:], kept, counts, scale)
            )
        print(f"{sample.task}/{sample.index}: budget {budget} of {context} "
              f"({time.perf_counter() - start:.0f}s)", flush=True)

    print(f"\n{len(samples)} prompts, {args.fraction:.0%} of the context kept (AdaKV + SnapKV, "
          f"kernel 15), {HELD_OUT} held-out queries x {decoder.model.config.num_attention_heads} "
          "query heads per prompt and layer; means over them\n")
    print("| layer | ‖f_R − f‖/‖f‖ | ‖f̂ − f‖/‖f‖ | correction better | w_E | ŵ_E | cos(f_E, f_R) |")
    print("|---|---|---|---|---|---|---|")
    overall = {name: [] for name in ("err_r", "err_hat", "better")}
    for index in sorted(per_layer):
        rows = {name: torch.cat([r[name] for r in per_layer[index]]) for name in per_layer[index][0]}
        better = (rows["err_hat"] < rows["err_r"]).double().mean()
        overall["err_r"].append(float(rows["err_r"].mean()))
        overall["err_hat"].append(float(rows["err_hat"].mean()))
        overall["better"].append(float(better))
        print(f"| {index} | {rows['err_r'].mean():.3f} | {rows['err_hat'].mean():.3f} | {better:.0%} | "
              f"{rows['w_e'].mean():.3f} | {rows['w_e_hat'].mean():.3f} | {rows['cos'].mean():.2f} |")
    print(f"| all | {statistics.mean(overall['err_r']):.3f} | {statistics.mean(overall['err_hat']):.3f} | "
          f"{statistics.mean(overall['better']):.0%} | | | |")


if __name__ == "__main__":
    main()
