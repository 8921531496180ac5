"""Every shipped config beside the selection it builds on: one Markdown table
from the `kvevict eval --engine reference` runs at each kept fraction.

    python benchmarks/config_study.py benchmarks/config_study/results_0.5 benchmarks/config_study/results_0.2

Each folder is one fraction's `--out` (its samples.jsonl; the fraction is read
from the setting names, `NAME@F`; `full`, which keeps everything whatever the fraction, is read from
whichever folder holds it and paired at every fraction). Per pair below: each setting's mean score
on the samples both answered, A - B with its 95% paired bootstrap interval
(stratified by task, `ruler_eval.compare`), and **≠0** where the interval
excludes 0. Then each setting's own mean and interval over all its samples.
``NAME+agnostic`` settings are query-agnostic: the prompt's context evicted
before its question is read (`kvevict eval` settings, ``+agnostic``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_kvevict.evaluation.records import RecordLog
from vllm_kvevict.evaluation.ruler_eval import MEAN_ROW, compare, summarize

# (A, B, what A - B isolates). Names are shipped configs (configs/NAME.yaml) or
# variants in benchmarks/config_study/.
PAIRS = [
    ("adakv_snapkv", "snapkv", "AdaKV head budgets (floor 0.2) against uniform"),
    ("momentkv_base", "adakv_snapkv", "configs/momentkv_base.yaml: the same config as adakv_snapkv"),
    ("momentkv", "adakv_snapkv", "MomentKV against its selection without moments (momentkv_base)"),
    ("momentkv", "snapkv", "MomentKV against uniform SnapKV"),
    ("momentkv_correction_only", "adakv_snapkv", "the correction in attention alone, same selection"),
    ("momentkv_diagonal", "adakv_snapkv", "MomentKV, diagonal covariance, against its selection"),
    ("momentkv_zeroth_order", "adakv_snapkv", "MomentKV, no covariance, against its selection"),
    ("criticalkv", "expected_attention", "CriticalKV (configs/criticalkv.yaml: on Expected Attention) against its base"),
    ("criticalkv", "snapkv", "CriticalKV (configs/criticalkv.yaml) against uniform SnapKV"),
    ("criticalkv_snapkv", "adakv_snapkv", "CriticalKV on AdaKV + SnapKV (the paper's setting) against its base"),
    ("criticalkv_snapkv", "snapkv", "CriticalKV on AdaKV + SnapKV against uniform SnapKV"),
    ("criticalkv_eps1e6", "adakv_snapkv", "CriticalKV on SnapKV, ε 1e-6, against its base"),
    ("criticalkv_stage1_075", "adakv_snapkv", "CriticalKV on SnapKV, first_stage_ratio 0.75, against its base"),
    ("criticalkv_pooled", "adakv_snapkv", "CriticalKV on SnapKV, stage 2 pooled over 15, against its base"),
    ("criticalkv_pooled_075", "adakv_snapkv", "CriticalKV on SnapKV, pooled stage 2 and ratio 0.75, against its base"),
    ("expected_attention", "expected_attention_uniform", "Expected Attention: AdaKV heads against uniform"),
    ("pyramidkv", "snapkv", "PyramidKV (configs/pyramidkv.yaml: β 1.5) against uniform SnapKV"),
    ("pyramidkv_beta2", "snapkv", "PyramidKV, β 2, against uniform SnapKV"),
    ("pyramidkv_beta5", "snapkv", "PyramidKV, β 5, against uniform SnapKV"),
    ("pyramidkv_beta20", "snapkv", "PyramidKV, β 20 (the paper's), against uniform SnapKV"),
    ("pyramidkv", "pyramidkv_beta2", "β 1.5 against 2"),
    ("pyramidkv_beta2", "pyramidkv_beta20", "β 2 against 20"),
    ("defensivekv", "criticalkv_snapkv", "DefensiveKV's worst-case aggregation against CriticalKV on AdaKV + SnapKV"),
    ("layer_defensivekv", "defensivekv", "Layer-DefensiveKV: one ranking over every layer against AdaKV per layer"),
    ("layer_defensivekv", "momentkv", "Layer-DefensiveKV against MomentKV"),
    ("layer_defensivekv", "snapkv", "Layer-DefensiveKV against uniform SnapKV"),
    ("full", "layer_defensivekv", "the full cache against Layer-DefensiveKV: what is left to close"),
    ("full", "snapkv", "the full cache against uniform SnapKV"),
    ("kvzip", "snapkv", "KVzip (reference evaluation only) against uniform SnapKV"),
    ("kvzip", "layer_defensivekv", "KVzip against Layer-DefensiveKV"),
    ("kvzip", "full", "KVzip against the full cache"),
    ("defensivekv_per_chunk", "defensivekv", "DefensiveKV evicting per prompt chunk (query-agnostic) against once at the end"),
    ("layer_defensivekv_per_chunk", "layer_defensivekv", "Layer-DefensiveKV per prompt chunk against once at the end"),
    ("layer_defensivekv_per_chunk", "snapkv", "Layer-DefensiveKV per prompt chunk (query-agnostic) against SnapKV at the end"),
    ("defensivekv_floor0", "defensivekv", "DefensiveKV without AdaKV's per-head floor against the shipped 0.2"),
    ("layer_defensivekv+agnostic", "full", "Layer-DefensiveKV on the context alone against the full cache"),
    # Query-agnostic (NAME+agnostic): the context evicted before the question
    # is read, as KVzip and DefensiveKV report.
    ("kvzip+agnostic", "snapkv", "KVzip on the context alone against query-aware SnapKV"),
    ("kvzip+agnostic", "full", "KVzip on the context alone against the full cache"),
    ("kvzip+agnostic", "kvzip", "KVzip on the context alone against KVzip after the whole prompt"),
    ("kvzip+agnostic", "layer_defensivekv+agnostic", "the two best query-agnostic policies"),
    ("layer_defensivekv+agnostic", "layer_defensivekv", "Layer-DefensiveKV: context alone against the whole prompt"),
    ("layer_defensivekv+agnostic", "snapkv", "Layer-DefensiveKV on the context alone against query-aware SnapKV"),
    ("defensivekv+agnostic", "defensivekv", "DefensiveKV: context alone against the whole prompt"),
    ("criticalkv+agnostic", "criticalkv", "CriticalKV: context alone against the whole prompt"),
    ("expected_attention+agnostic", "expected_attention", "Expected Attention: context alone against the whole prompt"),
    ("momentkv+agnostic", "momentkv", "MomentKV: context alone against the whole prompt"),
    ("snapkv+agnostic", "snapkv", "SnapKV: context alone against the whole prompt"),
    # Configs that evict after every prompt chunk and build on no other
    # selection: against SnapKV (the end-of-prompt selection) for scale.
    ("learned", "snapkv", "learned global eviction (shipped gates, per chunk): no base; SnapKV for scale"),
    ("keydiff", "snapkv", "KeyDiff (per chunk): no base; SnapKV for scale"),
    ("knorm", "snapkv", "Knorm (per chunk): no base; SnapKV for scale"),
    ("streamingllm", "snapkv", "StreamingLLM (per chunk): no base; SnapKV for scale"),
    ("random", "snapkv", "random (per chunk): no base; SnapKV for scale"),
]


def fraction_of(folder: Path) -> tuple[str, list]:
    records = list(RecordLog(folder / "samples.jsonl").records.values())
    fractions = {r.setting.rsplit("@", 1)[1] for r in records if "@" in r.setting}
    if len(fractions) != 1:
        raise SystemExit(f"{folder}: expected one kept fraction, found {sorted(fractions) or 'none'}")
    return fractions.pop(), records


def named(name: str, fraction: str) -> str:
    """A setting's name in the records: ``NAME@F``, or ``full`` alone."""
    return name if name == "full" else f"{name}@{fraction}"


def cell(records: list, a: str, b: str) -> str:
    names = {r.setting for r in records}
    if a not in names or b not in names:
        return "not run"
    mean = next(r for r in compare(records, a, b) if r.row == MEAN_ROW and r.length is not None)
    d = mean.difference
    mark = " **≠0**" if d.excludes_zero else ""
    return f"{d.n}: {mean.mean_a:.1f} vs {mean.mean_b:.1f}, {d.format(1, sign=True)}{mark}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="one `kvevict eval --out` folder per fraction")
    args = parser.parse_args()
    runs = [fraction_of(folder) for folder in args.folders]
    full = {(r.length, r.task, r.index): r for _, records in runs for r in records if r.setting == "full"}
    runs = [
        (f, [r for r in records if r.setting != "full"] + list(full.values())) for f, records in runs
    ]
    head = " | ".join(f"{float(f):.0%} kept: pairs, A vs B, A − B [95%]" for f, _ in runs)
    print(f"| A | B | isolates | {head} |")
    print("|---|---|---|" + "---|" * len(runs))
    for a, b, what in PAIRS:
        cells = " | ".join(cell(records, named(a, f), named(b, f)) for f, records in runs)
        print(f"| {a} | {b} | {what} | {cells} |")
    print()
    names = list(dict.fromkeys(r.setting.rsplit("@", 1)[0] for _, records in runs for r in records))
    print("| setting | " + " | ".join(f"{float(f):.0%} kept: samples, mean [95%]" for f, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in names:
        cells = []
        for f, records in runs:
            setting = named(name, f)
            found = summarize([r for r in records if r.setting == setting], [setting])
            cells.append(f"{found[0].samples}: {found[0].mean_interval.format(1)}" if found else "not run")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
