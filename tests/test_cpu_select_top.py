"""The C++ selection (``csrc/select_top.cpp``) against the torch paths of
``top_k.py`` and a stable sort, on scores full of ties, and the allocations of
``eviction/allocation.py`` served by either."""

import pytest
import torch

from vllm_kvevict import cpu_ops
from vllm_kvevict import top_k as allocation  # the module whose switch the tests read
from vllm_kvevict.eviction.allocation import AdaKVAllocation, global_top_b
from vllm_kvevict.top_k import select_top, top_k_mask, use_native_selection

INF = float("inf")


@pytest.fixture(scope="module")
def module():
    module = cpu_ops.load_cpu_ops()
    if module is None:
        pytest.fail("the C++ CPU kernel failed to build; see the warning logged by load_cpu_ops")
    return module


@pytest.fixture
def native(module):
    """Selections served by the C++ extension for one test, torch again after."""
    use_native_selection(module)
    yield module
    use_native_selection(None)


def _scores(gen, rows, width, dtype, tied):
    if tied:  # five levels, ±inf among them: SnapKV's max pooling, sinks, padding
        levels = torch.tensor([-INF, 0.25, 0.5, 1.0, INF], dtype=dtype)
        return levels[torch.randint(0, 5, (rows, width), generator=gen)]
    return torch.rand(rows, width, generator=gen, dtype=dtype)


def _stable_first(row, k):
    return sorted(sorted(range(len(row)), key=lambda s: (-float(row[s]), s))[: max(k, 0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(12))
def test_cpp_top_k_equals_a_stable_sort_and_the_torch_path(module, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 80, (1,), generator=gen))
    scores = _scores(gen, rows, width, dtype, tied=seed % 3 != 0)
    k = torch.randint(-1, width + 3, (rows,), generator=gen)  # below 0 and past the row too
    mask = module.top_k_mask(scores, k)
    kept = module.top_k_indices(scores, k)
    assert torch.equal(mask, top_k_mask(scores, k))  # the torch path (no extension registered)
    assert torch.equal(kept, select_top(scores, k))
    assert kept.shape == (rows, max(int(k.max()), 0))
    for r in range(rows):
        expected = _stable_first(scores[r], int(k[r]))
        assert mask[r].nonzero().view(-1).tolist() == expected
        assert kept[r, : len(expected)].tolist() == expected
        assert bool((kept[r, len(expected) :] == -1).all())


@pytest.mark.parametrize("seed", range(8))
def test_selections_keep_the_same_tokens_through_the_extension(native, seed):
    """AdaKV's counts, the per-head top-k and the global top-B are the same
    whether torch or the extension ranks the rows."""
    gen = torch.Generator().manual_seed(seed)
    scores = _scores(gen, 4, 300, torch.float32, tied=seed % 2 == 0)
    live = int((scores > -INF).sum())
    total = int(torch.randint(1, live + 1, (1,), generator=gen))
    served = (
        AdaKVAllocation(0.2).token_counts(scores, total),
        global_top_b(scores, total, floor=int(seed % 3)) if total >= 4 * (seed % 3) else None,
    )
    counts = served[0]
    kept = select_top(scores, counts)
    use_native_selection(None)
    assert torch.equal(served[0], AdaKVAllocation(0.2).token_counts(scores, total))
    if served[1] is not None:
        assert torch.equal(served[1], global_top_b(scores, total, floor=int(seed % 3)))
    assert torch.equal(kept, select_top(scores, counts))


def test_only_cpu_float_scores_take_the_extension(native):
    assert allocation._native_for(torch.zeros(2, 3)) is native
    assert allocation._native_for(torch.zeros(2, 3, dtype=torch.float64)) is native
    assert allocation._native_for(torch.zeros(2, 3, dtype=torch.bfloat16)) is None
    assert allocation._native_for(torch.zeros(2, 3, device="meta")) is None


def test_bad_inputs_raise(module):
    with pytest.raises(RuntimeError, match="k must be"):
        module.top_k_mask(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="float32 or float64"):
        module.top_k_indices(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.long))
