"""A request's own eviction settings, read from its extra arguments
(``SamplingParams.extra_args``; ``vllm_xargs`` in the OpenAI API): its own
budget, at most the server's, or off.

The front end validates them (:mod:`~vllm_kvevict.plugin.frontend.request_guard`);
the scheduler's manager and the workers each build the request's schedule from
the same arguments with :func:`request_schedule`, so all three agree without
talking to each other. A request that opted out runs on
:data:`~vllm_kvevict.schedule.NEVER_EVICTS`, the one schedule that never evicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_kvevict.config import EvictionConfig, KVEvictionConfigError
from vllm_kvevict.schedule import NEVER_EVICTS, EvictionSchedule, Schedule, cdiv

# Per-request settings, in a request's extra arguments (SamplingParams.extra_args,
# vllm_xargs in the OpenAI API). vllm_xargs holds scalars only, hence the flat
# spelling of the budget beside the nested one.
REQUEST_KEY = "kv_eviction"  # {"budget": N} or "off"
REQUEST_BUDGET_KEY = "kv_eviction_budget"  # N
REQUEST_OFF = "off"
REQUEST_SETTINGS = ("budget",)


@dataclass(frozen=True)
class RequestEviction:
    """One request's eviction settings: its own budget, or off (never evicted).

    Built from the request's extra arguments alone, in the front end (to
    validate), the scheduler and the workers, so all three agree on the
    request's schedule without talking to each other.
    """

    budget: int | None = None
    """Tokens each KV head keeps; None: the server's budget."""
    off: bool = False

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> RequestEviction:
        """Read the request's settings; :class:`KVEvictionConfigError` (one line
        naming the fix) when they are malformed. Limits that depend on the
        server are checked by :meth:`check`."""
        if not extra_args:
            return cls()
        unknown = sorted(
            key for key in extra_args
            if key.startswith(REQUEST_KEY) and key not in (REQUEST_KEY, REQUEST_BUDGET_KEY)
        )
        if unknown:
            raise KVEvictionConfigError(
                f"unknown per-request setting {unknown[0]!r}; the settings are "
                f'{{"{REQUEST_BUDGET_KEY}": 256}} and {{"{REQUEST_KEY}": "off"}}'
            )
        if REQUEST_KEY not in extra_args and REQUEST_BUDGET_KEY not in extra_args:
            return cls()
        nested, flat = extra_args.get(REQUEST_KEY), extra_args.get(REQUEST_BUDGET_KEY)
        if REQUEST_KEY in extra_args and REQUEST_BUDGET_KEY in extra_args:
            raise KVEvictionConfigError(
                f"give either {REQUEST_KEY!r} or {REQUEST_BUDGET_KEY!r}, not both; "
                f'e.g. {{"{REQUEST_BUDGET_KEY}": 256}} or {{"{REQUEST_KEY}": "off"}}'
            )
        if REQUEST_BUDGET_KEY in extra_args:
            return cls(budget=_request_budget(flat, REQUEST_BUDGET_KEY))
        if nested == REQUEST_OFF:
            return cls(off=True)
        if isinstance(nested, dict):
            unknown = sorted(set(nested) - set(REQUEST_SETTINGS))
            if unknown:
                raise KVEvictionConfigError(
                    f"unknown {REQUEST_KEY} setting {unknown[0]!r}; the only per-request "
                    f'setting is "budget" ({{"{REQUEST_KEY}": {{"budget": 256}}}}), or pass '
                    f'{{"{REQUEST_KEY}": "off"}}'
                )
            if "budget" not in nested:
                return cls()
            return cls(budget=_request_budget(nested["budget"], f"{REQUEST_KEY}.budget"))
        raise KVEvictionConfigError(
            f"{REQUEST_KEY} must be \"off\" or a mapping such as {{\"budget\": 256}}, got "
            f"{nested!r}; through vllm_xargs pass {{\"{REQUEST_BUDGET_KEY}\": 256}} or "
            f"{{\"{REQUEST_KEY}\": \"off\"}}"
        )

    @property
    def is_default(self) -> bool:
        return self.budget is None and not self.off

    def check(self, config: EvictionConfig | None, block_size: int | None = None) -> None:
        """The limits of the serving engine (``config``: its eviction settings,
        None without --kv-eviction; ``block_size``: its KV-cache block size);
        :class:`KVEvictionConfigError` when the request cannot be served as asked."""
        if self.is_default:
            return
        if config is None:
            raise KVEvictionConfigError(
                f"{REQUEST_KEY} settings need a server started with --kv-eviction; this one "
                f"runs without KV-cache eviction: drop {REQUEST_KEY} from the request"
            )
        if config.pools_layers:
            raise KVEvictionConfigError(
                f"per-request {REQUEST_KEY} settings need storage 'slots' or 'head_pages', and "
                f"this server ranks every layer together (head_budget {config.head_budget!r}); "
                f"drop {REQUEST_KEY} from the request (it is served with the server's budget)"
            )
        if self.budget is None:
            return
        floor = max(config.sink_tokens + config.recent_window, 1)
        if self.budget < floor:
            raise KVEvictionConfigError(
                f"{REQUEST_KEY} budget {self.budget} cannot hold the server's sink_tokens + "
                f"recent_window ({floor}); ask for a budget of at least {floor}"
            )
        if config.uses_head_pages and block_size and self.budget // block_size * block_size < floor:
            least = cdiv(floor, block_size) * block_size
            raise KVEvictionConfigError(
                f"{REQUEST_KEY} budget {self.budget} rounds down to "
                f"{self.budget // block_size * block_size} with storage head_pages (whole blocks "
                f"of {block_size} tokens per head), which cannot hold sink_tokens + "
                f"recent_window ({floor}); ask for a budget of at least {least}"
            )
        if self.budget > config.budget:
            raise KVEvictionConfigError(
                f"{REQUEST_KEY} budget {self.budget} is above this server's budget "
                f"{config.budget} (what its memory was provisioned for); ask for at most "
                f'{config.budget}, or {{"{REQUEST_KEY}": "off"}} to keep every token'
            )

    def schedule(self, server: EvictionSchedule) -> Schedule:
        """The request's schedule: the server's with the request's budget
        (never above the server's), or :data:`NEVER_EVICTS` when it opted out."""
        if self.off:
            return NEVER_EVICTS
        if self.budget is None or self.budget >= server.budget:
            return server
        return dataclasses.replace(server, budget=max(self.budget, 1))


def _request_budget(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEvictionConfigError(
            f"{name} must be a whole number of tokens, got {value!r}"
        )
    return value


def request_schedule(server: EvictionSchedule, extra_args: dict[str, Any] | None) -> Schedule:
    """The schedule of a request with these extra arguments on an engine whose
    schedule is ``server`` (:data:`NEVER_EVICTS` for one that opted out). The
    scheduler and the workers both call this on the same arguments. Settings the front end would have
    refused (it validates every request) fall back to the server's schedule,
    on both sides alike, rather than stop the engine."""
    try:
        settings = RequestEviction.from_extra_args(extra_args)
    except KVEvictionConfigError:
        return server
    return settings.schedule(server)
