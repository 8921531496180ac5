"""A bounded soak against the shared `vllm serve --kv-eviction snapkv`.

Two minutes by default; ``KVEVICT_SOAK_SECONDS=1800`` for a longer run. The
figures are printed to the terminal (also under ``pytest -q``).
"""

from __future__ import annotations

import os

import pytest

from vllm_kvevict.evaluation.soak import run_soak

pytestmark = pytest.mark.e2e

SOAK_SECONDS = float(os.environ.get("KVEVICT_SOAK_SECONDS", "120"))


def test_soak_loses_no_request_leaks_no_block_and_holds_memory(snapkv_server, tokenizer, capsys):
    # 12 clients for 8 engine slots and a pool of 160 blocks (5,120 tokens),
    # while a long prompt alone is up to 3,000 tokens: requests queue, and
    # every block changes hands many times.
    report = run_soak(
        snapkv_server, tokenizer, SOAK_SECONDS, clients=12, warmup_s=min(30, SOAK_SECONDS / 4)
    )
    with capsys.disabled():
        print(f"\nsoak against vllm serve --kv-eviction snapkv:\n{report.table()}")
    assert not report.failed, report.failed[:5]
    assert report.leak is None, report.leak
    assert sum(report.sent.values()) >= 12
    assert report.aborted > 0 or SOAK_SECONDS < 60
    assert all(w["nan_outputs"] == 0 for w in report.idle_workers)
    start, end = report.rss_after_warmup
    # Flat: allocator noise, not growth with the number of requests served.
    assert end - start < max(96.0, 0.05 * start), (start, end)
