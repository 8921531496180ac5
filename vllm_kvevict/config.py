"""The eviction configuration: one validated pydantic model.

It reaches every vLLM process as ``vllm_config.additional_config["kv_eviction"]``
(a plain dict, so it pickles across the spawned engine and worker processes
and hashes into vLLM's compile cache key), whether it came from
``vllm serve --kv-eviction`` or from
``LLM(..., additional_config={"kv_eviction": {...}})``. Each process validates
given settings once: the same content gives back the same frozen
:class:`EvictionConfig`, with its policy object built once.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from vllm_kvevict.eviction.allocation import (
    AdaKVAllocation,
    GlobalAllocation,
    HeadAllocation,
    PyramidAllocation,
    UniformAllocation,
)
from vllm_kvevict.policies import POLICIES, EvictionPolicy, make_policy
from vllm_kvevict.policies.retention_gate import LearnedRetentionPolicy
from vllm_kvevict.schedule import EvictionSchedule

ADDITIONAL_CONFIG_KEY = "kv_eviction"
POISON_ENV = "KVEVICT_POISON_FREED_BLOCKS"


class KVEvictionConfigError(ValueError):
    """A configuration mistake, explained in one sentence that names the fix."""


class EvictionConfig(BaseModel):
    """Per-request KV-cache eviction settings (all lengths in tokens per KV head)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(description="eviction policy: " + ", ".join(sorted(POLICIES)))
    budget: int = Field(
        512,
        description="tokens each KV head keeps after an eviction (rounded up to "
        "fill the block the cut falls in, which the request holds anyway)",
    )
    sink_tokens: int = Field(4, ge=0, description="first tokens of the sequence always kept")
    recent_window: int = Field(
        32, ge=0, description="most recent tokens always kept at an eviction"
    )
    observation_window: int = Field(
        None,  # type: ignore[assignment]  # resolved per policy below
        ge=1,
        description="recent queries that query-based policies score with (default per "
        "policy: 32; expected_attention 128, the paper's query-statistics buffer; h2o "
        "256, the attention CriticalKV's authors accumulate for it)",
    )
    decode_interval: int = Field(
        32, ge=1, description="decode steps between two evictions (N)"
    )
    prefill_mode: Literal["per_chunk", "end_of_prompt", "hybrid"] = Field(
        None,  # type: ignore[assignment]  # resolved per policy below
        description="default per policy (snapkv: end_of_prompt, streamingllm: "
        "per_chunk); per_chunk: evict after every prefill chunk (memory bounded by "
        "budget + chunk, so prompts longer than the KV pool are served); end_of_prompt: "
        "hold the whole prompt during prefill and evict once at its end, so query-based "
        "policies score with the question (the full prompt must fit in memory: "
        "admission reserves it); hybrid: end_of_prompt for prompts up to "
        "end_of_prompt_max_tokens, per_chunk for longer ones",
    )
    prefill_interval: int | None = Field(
        None,
        ge=1,
        description="per_chunk/hybrid prefill_mode: prompt tokens between two evictions "
        "(default: the engine's --max-num-batched-tokens). Eviction points depend on the "
        "request alone, so its output does not depend on load or preemption",
    )
    end_of_prompt_max_tokens: int = Field(
        4096, ge=0, description="hybrid prefill_mode: longest prompt evicted once at its end"
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="options of the chosen policy, e.g. snapkv kernel_size"
    )
    poison_freed_blocks: bool = Field(
        False,
        description="debug: fill every block the plugin returns to vLLM's pool with NaN, "
        "and count attention outputs that contain NaN (isolation check; also turned on "
        "by the environment variable KVEVICT_POISON_FREED_BLOCKS=1)",
    )
    attention_kernel: Literal["auto", "native", "torch", "triton"] = Field(
        "auto",
        description="kernels over the retained tokens: auto (native on CPU, triton on "
        "CUDA); native (CPU: a C++ kernel, vLLM's on a shifted block table with slots "
        "storage, ours over per-head page tables); torch (CPU: the reference "
        "implementation); triton (the Triton kernels over per-head page tables with the "
        "MomentKV correction in the attention pass and the compaction kernel; on CPU they "
        "run under Triton's interpreter, which needs TRITON_INTERPRET=1 in the server's "
        "environment from the start)",
    )
    head_budget: Literal["uniform", "adaptive", "pyramid", "global"] = Field(
        None,  # type: ignore[assignment]  # resolved per policy: global for learned
        description="how retained tokens are split across KV heads: uniform (every head "
        "keeps budget tokens; the default) or adaptive (AdaKV: each layer keeps budget x "
        "KV heads tokens, the highest-scoring across its heads, each head at least "
        "head_budget_floor of an equal share) or pyramid (PyramidKV: the request keeps budget "
        "x layers x KV heads tokens, each layer a share falling linearly with depth, split "
        "equally over its heads; the default for pyramidkv) or global (policies whose scores "
        "share one scale across layers, learned (DBTrimKV), defensivekv, layer_defensivekv and "
        "kvzip: the request keeps budget x layers x KV heads tokens, the highest-scoring across every "
        "layer and head; the default for learned, layer_defensivekv and kvzip); adaptive, pyramid and "
        "global need storage head_pages",
    )
    head_budget_floor: float = Field(
        0.2, ge=0.0, le=1.0, description="adaptive head_budget: AdaKV's per-head safeguard"
    )
    pyramid_beta: float = Field(
        1.5, ge=1.0, le=1000.0, description="pyramid head_budget: the last layer keeps 1/beta of "
        "the mean budget (beyond sinks and recent window), the first 2 - 1/beta times it "
        "(PyramidKV's beta; on the default model no beta scored above uniform SnapKV, the "
        "flatter the closer: 1.5 within its interval, the paper's 20 below it)",
    )
    moment_correction: bool = Field(
        None,  # type: ignore[assignment]  # resolved per policy: on for momentkv
        description="MomentKV correction: fold every evicted token into per-(layer, KV "
        "head) moment statistics (count, means, value-key covariance; fp32, "
        "(1 + 2D + D^2) x 4 bytes per head) and add their closed-form contribution "
        "to every attention output (needs storage head_pages, and head_budget uniform or "
        "adaptive: the pooled layers' ranking folds no evicted token; default on for momentkv)",
    )
    moment_covariance: Literal["full", "diagonal", "none"] = Field(
        "full",
        description="rank of MomentKV's value-key cross-covariance: full (the paper's "
        "first-order correction; (1 + 2D + D^2) x 4 bytes per request, layer and KV "
        "head), diagonal (each value dim against its own key dim; (1 + 3D) x 4) or "
        "none (the zeroth-order correction, evicted tokens stand in as their mean "
        "value; (1 + 2D) x 4)",
    )
    storage: Literal["slots", "head_pages"] | None = Field(
        None,
        description="where retained tokens live: slots (each head in its own slots of "
        "the request's live blocks, read by vLLM's kernel) or head_pages (per-(layer, KV "
        "head) page tables over the head-pages of the request's blocks, so heads keep "
        "different numbers of tokens); default head_pages when head_budget is adaptive "
        "or moment_correction is on, else slots",
    )
    prefix_caching: Literal["off", "shared"] = Field(
        "off",
        description="off: vLLM's prefix caching is turned off; shared: it stays on, and "
        "each prompt's first whole blocks (those found in the cache, and up to "
        "max_protected_prefix_tokens) are never evicted, so they stay cached and shared "
        "between requests; the budget counts the tokens after them",
    )
    max_protected_prefix_tokens: int = Field(
        1024,
        ge=0,
        description="prefix_caching shared: most prompt tokens protected from eviction "
        "(whole blocks; a request holds them on top of its budget, once for every request "
        "that shares them)",
    )
    # The policy object, built (and its options checked) by validation.
    _policy: EvictionPolicy = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _policy_defaults(cls, data: Any) -> Any:
        """Settings left unset (or null) take the policy's own defaults."""
        if not isinstance(data, dict):
            return data
        name = data.get("policy")
        policy = POLICIES.get(name) if isinstance(name, str) else None
        if data.get("prefill_mode") is None and policy is not None:
            data = {**data, "prefill_mode": policy.default_prefill_mode}
        if data.get("moment_correction") is None:
            data = {**data, "moment_correction": bool(policy and policy.needs_moments)}
        if data.get("head_budget") is None:
            data = {**data, "head_budget": policy.default_head_budget if policy else "uniform"}
        if data.get("observation_window") is None:
            options = data.get("policy_options")
            window = policy.observation_window_for(options if isinstance(options, dict) else {}) if policy else 32
            data = {**data, "observation_window": window}
        return data

    @model_validator(mode="after")
    def _check(self) -> EvictionConfig:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.policy!r}; choose one of: "
                + ", ".join(sorted(POLICIES))
            )
        if self.budget < max(self.sink_tokens + self.recent_window, 1):
            raise ValueError(
                f"budget {self.budget} cannot hold sink_tokens ({self.sink_tokens}) + "
                f"recent_window ({self.recent_window}); raise budget to at least "
                f"{max(self.sink_tokens + self.recent_window, 1)} or shrink the window"
            )
        if POLICIES[self.policy].needs_moments and not self.moment_correction:
            raise ValueError(
                f"policy {self.policy!r} scores with the statistics of the evicted tokens, "
                "which moment_correction keeps; drop moment_correction: false"
            )
        if self.moment_covariance != "full" and not self.moment_correction:
            raise ValueError(
                f"moment_covariance {self.moment_covariance!r} shapes MomentKV's evicted-token "
                "statistics, which only moment_correction keeps; set moment_correction: true "
                "or policy momentkv, or drop moment_covariance"
            )
        policy = POLICIES[self.policy]
        if self.head_budget == "global" and not policy.global_scores:
            raise ValueError(
                f"head_budget 'global' ranks the tokens of every layer on one scale, which "
                f"policy {self.policy!r} does not give; use head_budget 'adaptive' (per layer) "
                "or policy 'learned' or 'layer_defensivekv'"
            )
        if self.head_budget == "global" and self.moment_correction:
            raise ValueError(
                "head_budget 'global' ranks every layer after the model's last layer and folds no "
                "evicted token into moments, so moment_correction would correct nothing; drop "
                "moment_correction, or use head_budget 'adaptive' for the correction"
            )
        if self.head_budget == "pyramid" and (
            self.moment_correction or policy.needs_rotary or policy.needs_output_projection
            or policy.needs_log_beta
        ):
            raise ValueError(
                f"head_budget 'pyramid' ranks every layer after the model's last layer, where it "
                f"has each layer's keys, values and observation queries only; policy "
                f"{self.policy!r}{' with moment_correction' if self.moment_correction else ''} "
                "needs more: use head_budget 'adaptive' or 'uniform', or a query- or key-based "
                "policy (snapkv, pyramidkv, knorm, keydiff, tova, h2o, streamingllm, random)"
            )
        if policy.needs_reconstruction and (
            self.prefill_mode != "end_of_prompt" or self.head_budget != "global"
        ):
            raise ValueError(
                f"policy {self.policy!r} scores the whole prompt once it has run (a second pass "
                "of the model repeats it) and ranks every layer and KV head at once; set "
                "prefill_mode 'end_of_prompt' and head_budget 'global' (its defaults)"
            )
        if policy.needs_log_beta and self.head_budget != "global":
            raise ValueError(
                f"policy {self.policy!r} ranks tokens across every layer and KV head; drop "
                f"head_budget {self.head_budget!r} (its default is 'global')"
            )
        if self.storage == "slots" and self.needs_head_pages:
            raise ValueError(
                "head_budget 'adaptive', 'pyramid' or 'global' and moment_correction need storage "
                "'head_pages'; "
                "drop storage 'slots'"
            )
        if self.prefix_caching == "shared" and self.pools_layers:
            raise ValueError(
                f"prefix_caching 'shared' keeps each prompt's first blocks in place, and "
                f"head_budget {self.head_budget!r} moves every layer's tokens into one pool; "
                "use head_budget 'uniform' or 'adaptive', or prefix_caching 'off'"
            )
        if self.prefix_caching == "shared" and policy.needs_queries and self.budget < self.observation_window:
            raise ValueError(
                f"with prefix_caching 'shared' a request may take its prefix from the cache "
                f"without computing its queries, so the observation window must lie after it: "
                f"raise budget ({self.budget}) to at least observation_window "
                f"({self.observation_window})"
            )
        self._policy = make_policy(self.policy, self.policy_options)
        return self

    @property
    def pools_layers(self) -> bool:
        """Layers trade pages: every layer's streams are ranked together after
        the model's last layer, in the pool of every layer's blocks."""
        return self.head_budget in ("pyramid", "global")

    @property
    def needs_head_pages(self) -> bool:
        return self.head_budget != "uniform" or self.moment_correction

    @property
    def uses_head_pages(self) -> bool:
        if self.storage is None:
            return self.needs_head_pages
        return self.storage == "head_pages"

    @property
    def storage_name(self) -> Literal["slots", "head_pages", "global"]:
        """How a request's retained tokens are stored: ``slots`` (vLLM's pages,
        compacted), ``head_pages`` (a page table per layer and KV head) or
        ``global`` (head pages ranked across every layer)."""
        return "global" if self.pools_layers else "head_pages" if self.uses_head_pages else "slots"

    def summary(self, attention_kernel: str) -> str:
        """The settings a server runs, in one line (its start-up log), with the
        attention kernel that serves them (``attention_kernel`` resolved)."""
        prefill = self.prefill_mode
        if self.prefill_mode == "per_chunk" and self.prefill_interval:
            prefill += f" every {self.prefill_interval} tokens"
        prefix = (
            f"shared, up to {self.max_protected_prefix_tokens} tokens protected"
            if self.prefix_caching == "shared" else "off"
        )
        moments = f", moment correction {self.moment_covariance}" if self.moment_correction else ""
        return (
            f"policy {self.policy}, budget {self.budget} tokens per KV head (sink {self.sink_tokens}, "
            f"recent {self.recent_window}), prefill {prefill}, decode every {self.decode_interval} "
            f"steps, storage {self.storage_name}, head budget {self.head_budget}{moments}, "
            f"attention kernel {attention_kernel}, prefix caching {prefix}"
        )

    def info_labels(self, attention_kernel: str) -> dict[str, str]:
        """:meth:`summary`'s settings as the labels of ``kvevict_config_info``."""
        return {
            "budget": str(self.budget), "sink_tokens": str(self.sink_tokens),
            "recent_window": str(self.recent_window), "prefill_mode": self.prefill_mode,
            "decode_interval": str(self.decode_interval), "storage": self.storage_name,
            "head_budget": self.head_budget,
            "moment_correction": self.moment_covariance if self.moment_correction else "off",
            "attention_kernel": attention_kernel, "prefix_caching": self.prefix_caching,
        }

    def kernel_for(self, device_type: str) -> Literal["native", "torch", "triton"]:
        """The attention kernel on ``device_type`` ("cpu" or "cuda"): ``auto``
        resolved (native on CPU, triton on CUDA)."""
        if self.attention_kernel == "auto":
            return "triton" if device_type == "cuda" else "native"
        return self.attention_kernel

    def build_policy(self) -> EvictionPolicy:
        """The policy object with its options (built once: policies keep no
        state between evictions)."""
        return self._policy

    def build_allocation(self) -> HeadAllocation:
        if self.head_budget == "adaptive":
            return AdaKVAllocation(self.head_budget_floor)
        if self.head_budget == "pyramid":
            return PyramidAllocation(self.pyramid_beta)
        if self.head_budget == "global":
            # Validation admits global only for a policy that scores every
            # layer on one scale (global_scores).
            policy = self.build_policy()
            floor = policy.min_tokens_per_head if isinstance(policy, LearnedRetentionPolicy) else 0
            return GlobalAllocation(floor=floor)
        return UniformAllocation()

    def check_block_size(self, block_size: int) -> None:
        """head_pages storage keeps whole blocks' worth of pages per head: the
        smallest capacity after an eviction is ``budget`` rounded down to blocks
        (:attr:`EvictionSchedule.min_retained_blocks`)."""
        if not self.uses_head_pages:
            return
        # Capacities do not depend on the prefill interval.
        capacity = self.schedule(block_size, block_size).min_retained_blocks * block_size
        if capacity < max(self.sink_tokens + self.recent_window, 1):
            raise KVEvictionConfigError(
                f"with storage head_pages a head keeps whole blocks of {block_size} "
                f"tokens, and budget {self.budget} rounds down to {capacity}, which cannot "
                f"hold sink_tokens + recent_window ({self.sink_tokens + self.recent_window}); "
                f"raise budget to at least "
                f"{max(-(-(self.sink_tokens + self.recent_window) // block_size), 1) * block_size}"
            )

    def schedule(self, block_size: int, default_prefill_interval: int) -> EvictionSchedule:
        """The schedule of these settings, the one place one is built from
        them; ``default_prefill_interval`` applies when none is set."""
        return EvictionSchedule(
            self.budget, self.decode_interval, block_size, self.prefill_mode,
            self.end_of_prompt_max_tokens,
            self.prefill_interval or default_prefill_interval,
            self.max_protected_prefix_tokens if self.prefix_caching == "shared" else 0,
        )

    @property
    def poisons_freed_blocks(self) -> bool:
        return self.poison_freed_blocks or os.environ.get(POISON_ENV, "") not in ("", "0")

    def to_additional_config(self) -> dict[str, Any]:
        return self.model_dump()


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    if first.get("type") == "extra_forbidden":
        valid = ", ".join(EvictionConfig.model_fields)
        return f"unknown setting {first['loc'][-1]!r}; valid settings are: {valid}"
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = first.get("msg", str(error)).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def parse_config_source(source: str) -> dict[str, Any]:
    """Read ``--kv-eviction-config``: inline JSON, a path to a JSON/YAML file, or a
    config shipped with the package, by name (``snapkv``) or by its path in the
    repository (``configs/snapkv.yaml``, found in an installed wheel too). A file
    that exists wins over a shipped config of the same name."""
    text = source.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVEvictionConfigError(
                f"--kv-eviction-config is not valid JSON ({exc.msg} at column {exc.colno}); "
                "pass a JSON object or a path to a .json/.yaml file"
            ) from None
    else:
        if not os.path.isfile(text):
            from vllm_kvevict.paths import shipped_config, shipped_configs

            shipped = shipped_config(text)
            if shipped is None:
                raise KVEvictionConfigError(
                    f"--kv-eviction-config {text!r} is neither inline JSON nor an existing "
                    "file nor a shipped config; pass a JSON object, a path to a .json/.yaml "
                    f"file or a shipped config name ({', '.join(shipped_configs()) or 'none installed'})"
                )
            text = str(shipped)
        with open(text, encoding="utf-8") as handle:
            content = handle.read()
        try:
            if text.endswith(".json"):
                data = json.loads(content)
            else:
                import yaml

                data = yaml.safe_load(content)
        except Exception as exc:  # json.JSONDecodeError or yaml.YAMLError
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise KVEvictionConfigError(
                f"cannot parse {text!r} ({first_line}); fix the file's syntax"
            ) from None
    if not isinstance(data, dict):
        raise KVEvictionConfigError(
            "--kv-eviction-config must hold a mapping of settings, e.g. "
            '\'{"budget": 512}\''
        )
    return data


# Validated configs of this process, by the canonical JSON of their settings.
_validated: dict[str, EvictionConfig] = {}
_MAX_REMEMBERED = 256


def _content_key(data: dict[str, Any]) -> str | None:
    """The settings' canonical JSON; None when they are not plain JSON data."""
    try:
        return json.dumps(data, sort_keys=True)
    except (TypeError, ValueError):
        return None


def build_config(data: dict[str, Any]) -> EvictionConfig:
    """Validate settings. Within a process the same content (or the dump of a
    config built before) gives back the same config object."""
    key = _content_key(data)
    if key is not None and key in _validated:
        return _validated[key]
    try:
        config = EvictionConfig(**data)
    except ValidationError as exc:
        raise KVEvictionConfigError(f"invalid KV eviction config: {_describe(exc)}") from None
    if key is not None:
        if len(_validated) >= _MAX_REMEMBERED:
            _validated.clear()
        _validated[key] = config
        dumped = _content_key(config.to_additional_config())
        if dumped is not None:
            _validated.setdefault(dumped, config)
    return config


def check_served(config: EvictionConfig) -> None:
    """Refuse (:class:`KVEvictionConfigError`, naming the fix) a config the
    vLLM plugin cannot serve: a policy scored by a pass that only the
    reference decoder runs (kvzip's reconstruction)."""
    if config.build_policy().needs_reconstruction:
        raise KVEvictionConfigError(
            f"{config.policy} is scored by the reference evaluation only: use kvevict eval "
            "--engine reference"
        )


def config_from_cli(policy: str | None, config_source: str | None) -> EvictionConfig | None:
    """Combine ``--kv-eviction`` and ``--kv-eviction-config``; a config that
    names another policy than the flag is refused (its settings were meant
    for that policy), as is one the plugin cannot serve (:func:`check_served`)."""
    if policy is None and config_source is None:
        return None
    data = parse_config_source(config_source) if config_source is not None else {}
    if policy is not None:
        named = data.get("policy")
        if named is not None and named != policy:
            raise KVEvictionConfigError(
                f"--kv-eviction {policy} and --kv-eviction-config's policy {named!r} differ; "
                f"give one policy: --kv-eviction {named}, or a config for {policy} "
                f"(or one without 'policy')"
            )
        data["policy"] = policy
    if "policy" not in data:
        raise KVEvictionConfigError(
            "--kv-eviction-config names no policy; add --kv-eviction POLICY "
            f"(one of: {', '.join(sorted(POLICIES))})"
        )
    config = build_config(data)
    check_served(config)
    return config


def config_from_additional(additional_config: dict[str, Any] | None) -> EvictionConfig | None:
    """The eviction config carried by a ``VllmConfig``, or None when eviction is off.

    Every call in a process with the same settings returns the same object;
    a config the plugin cannot serve is refused (:func:`check_served`)."""
    if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
        return None
    data = additional_config[ADDITIONAL_CONFIG_KEY]
    if isinstance(data, str):
        data = parse_config_source(data)
    if not isinstance(data, (dict, EvictionConfig)):
        raise KVEvictionConfigError(
            'additional_config["kv_eviction"] must be a mapping such as '
            '{"policy": "snapkv", "budget": 512}'
        )
    config = data if isinstance(data, EvictionConfig) else build_config(data)
    check_served(config)
    return config


def help_text() -> str:
    """The settings table shown by ``vllm serve --help``."""
    lines = []
    for name, field in EvictionConfig.model_fields.items():
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        lines.append(f"{name} ({default}): {field.description}")
    return "; ".join(lines)
