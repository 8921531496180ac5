"""Test helpers: the evaluation tools, the shared server's settings, and what
each pytest-xdist worker sets for the engines it starts."""

import functools
import os

from vllm_kvevict.evaluation.server import PORT_RANGE_ENV, VllmServer, free_port, vllm_executable  # noqa: F401
from vllm_kvevict.evaluation.tasks import needle_prompt  # noqa: F401

# The shared test server's eviction settings (see configs/snapkv.yaml for why
# kernel 15 on the default model).
SNAPKV_SERVER_CONFIG = {"policy": "snapkv", "budget": 512, "policy_options": {"kernel_size": 15}}
# The shared head_pages server's: AdaKV head budgets over SnapKV scores, with
# the MomentKV correction.
HEAD_PAGES_SERVER_CONFIG = {**SNAPKV_SERVER_CONFIG, "head_budget": "adaptive", "moment_correction": True}


def model_block_bytes(model_dir: str, block_size: int = 32) -> int:
    """Bytes of one fp32 KV block of the model in ``model_dir``, every layer."""
    import json
    from pathlib import Path

    from vllm_kvevict.evaluation.serving_bench import kv_block_bytes

    return kv_block_bytes(json.loads((Path(model_dir) / "config.json").read_text()), block_size, 4)


def eviction_server_args(config: dict, pool_blocks: int) -> list[str]:
    """`vllm serve` arguments of the tests' servers: the default model in fp32,
    4k context, 512-token chunks, a KV pool of ``pool_blocks`` blocks of 32."""
    import json

    from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

    return [
        "--kv-eviction", config["policy"],
        "--kv-eviction-config", json.dumps(config),
        "--dtype", "float32", "--max-model-len", "4096", "--block-size", "32",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--kv-cache-memory-bytes", str(pool_blocks * DEFAULT_MODEL_BLOCK_BYTES + 4096),
    ]


def kvevict_samples(exposition: str) -> dict[tuple[str, tuple], float]:
    """The plugin's samples in a Prometheus exposition, keyed by (name, sorted labels).

    Fails on a series exported twice: Prometheus rejects such a scrape.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith("kvevict_"):
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in samples, f"series exported twice: {key}"
                samples[key] = sample.value
    return samples


# Each pytest-xdist worker's own ports: PORTS_PER_WORKER from PORTS_START up,
# below the kernel's ephemeral range (from 32768 by default), where vLLM's own
# ports come from.
PORTS_START = 20000
PORTS_PER_WORKER = 500


def worker_environment(worker: str, cores: list[int]) -> dict[str, str]:
    """The variables a pytest-xdist worker (``gw0``, ``gw1``, ...; ``""``
    outside xdist) sets for itself and every process it starts, given the
    machine's allowed ``cores``:

    * ``VLLM_CPU_OMP_THREADS_BIND``: a core of its own (the cores in turn) for
      every engine it starts. vLLM's CPU worker otherwise binds itself to the
      first core, so every engine of the run would share that one;
    * ``OMP_NUM_THREADS=1``: torch in the tests, and in engines run in a test's
      own process (which vLLM does not bind; see ``bind_to_engine_core``),
      keeps to one thread;
    * ``KVEVICT_PORT_RANGE``: ports of its own (``free_port``).

    Nothing outside xdist: one process then has the machine to itself.
    """
    if not worker.startswith("gw"):
        return {}
    index = int(worker[2:])
    first = PORTS_START + index * PORTS_PER_WORKER
    return {
        "VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)]),
        "OMP_NUM_THREADS": "1",
        PORT_RANGE_ENV: f"{first}-{first + PORTS_PER_WORKER - 1}",
    }


def engine_cores() -> set[int] | None:
    """The cores ``VLLM_CPU_OMP_THREADS_BIND`` gives an engine of one rank
    (this pytest-xdist worker's core); None when it names none (unset,
    ``auto``, ``nobind``, or one list per rank)."""
    text = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if text in ("auto", "nobind") or "|" in text:
        return None
    cores: set[int] = set()
    for part in text.split(","):  # vLLM's lists: "3", "0,2", "4-7"
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def bind_to_engine_core() -> None:
    """``preexec_fn`` of a test's subprocess whose engine vLLM does not bind to
    the worker's core: an engine run in the subprocess itself
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM binds only the workers it starts
    in processes of their own), or a server in an image, which the worker's
    variables do not reach (there vLLM binds to the first core it is allowed).
    Binds the process, and so what it starts, to ``engine_cores()``; nothing
    when there are none."""
    cores = engine_cores()
    if cores is not None:
        os.sched_setaffinity(0, cores)


def ranks_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``ranks`` ranks (tensor
    parallel): a core each, from the first, when the run has the machine to
    itself; under pytest-xdist every rank on the worker's own core, so that the
    engine does not take the other worker's core from its engines."""
    if engine_cores() is None:
        return "|".join(str(core) for core in range(ranks))
    return "|".join([os.environ["VLLM_CPU_OMP_THREADS_BIND"]] * ranks)


UNSUPPORTED_LAYOUT = "Unsupported CPU attention configuration"


@functools.cache
def vllm_page_layouts() -> frozenset[str]:
    """The page layouts (vLLM's CPU attention ISAs: ``vec``, ``vec16``,
    ``amx``) that the vLLM build loaded on this CPU writes. vLLM loads its
    AVX-512 build only on CPUs with AVX-512; its AVX2 build has no ``amx``
    layout ("Unsupported CPU attention configuration")."""
    import torch
    from vllm import _custom_ops as ops

    layouts = set()
    for isa in ("vec", "vec16", "amx"):
        cache = torch.zeros(1, 1, 64, 32, dtype=torch.bfloat16)
        key_cache, value_cache = cache.chunk(2, dim=2)
        tokens = torch.zeros(32, 1, 32, dtype=torch.bfloat16)
        try:
            ops.cpu_attn_reshape_and_cache(
                tokens, tokens, key_cache, value_cache, torch.arange(32), isa,
                k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
            )
        except RuntimeError as exc:
            if UNSUPPORTED_LAYOUT not in str(exc):
                raise
        else:
            layouts.add(isa)
    return frozenset(layouts)


def layout_param(*values, isa: str):
    """``pytest.param(*values)`` of a case in vLLM's ``isa`` page layout,
    skipped (with the reason) where the vLLM build loaded on this CPU has no
    such layout."""
    import pytest

    return pytest.param(
        *values,
        marks=pytest.mark.skipif(
            isa not in vllm_page_layouts(),
            reason=f"vLLM's CPU build for this CPU has no '{isa}' page layout (its AVX-512 build has)",
        ),
    )
