"""What `kvevict eval`, `bench` and `soak` serve: settings (``--setting SPEC``).

A setting is the full cache (``full``; ``full-unbounded`` in `kvevict bench`:
the full cache in a KV pool that holds every request of the load), an eviction config kept at a fraction
of the prompt or at a fixed budget (``snapkv@0.25``, ``momentkv@0.5``,
``my-config.yaml@0.5``, ``tova@1024``; the tools start the server), or a
server that already runs (``NAME=URL``). ``--kv-eviction-config`` adds the
same options to every eviction setting. Budgets are checked with the plugin's own config rules before
any server starts, so a setting vLLM would refuse fails at once, naming the fix.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kvevict.config import EvictionConfig

FULL = "full"
FULL_UNBOUNDED = "full-unbounded"  # `kvevict bench` only: no eviction, no memory limit
PREFIX = "+prefix"  # a setting with vLLM's prefix caching on (eviction: prefix_caching shared)
AGNOSTIC = "+agnostic"  # evicts the context before the question is read (--engine reference)
DEFAULT_BLOCK_SIZE = 32
ANY_BUDGET = 1 << 16  # a budget no prompt of the tools reaches: checks that hold at any budget


@dataclass(frozen=True)
class ServingSetting:
    """One row of a report."""

    name: str
    url: str | None = None  # a running server
    eviction: dict[str, Any] | None = None  # the config without "budget"; None: no eviction
    fraction: float | None = None  # budget = fraction x mean prompt tokens, or
    budget_tokens: int | None = None  # a fixed budget
    unbounded: bool = False  # no eviction in a KV pool for every request at once (bench)
    prefix_caching: bool = False  # vLLM's prefix caching on (with eviction: prefix_caching shared)
    query_agnostic: bool = False  # the eviction at the context's end, the question read after it

    @property
    def managed(self) -> bool:
        return self.url is None

    @property
    def policy(self) -> str | None:
        return None if self.eviction is None else self.eviction["policy"]

    def budget(self, mean_prompt_tokens: float, block_size: int = DEFAULT_BLOCK_SIZE) -> int | None:
        """Tokens per (layer, KV head) kept after an eviction, whole blocks: a head
        fills the block its cut falls in anyway."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        if self.fraction is None:
            return None
        return int(self.fraction * mean_prompt_tokens) // block_size * block_size

    def config_at_any_budget(self) -> EvictionConfig:
        """The eviction setting's config at :data:`ANY_BUDGET`, for the checks
        that do not depend on the budget (the policy served, the prefill mode)."""
        from vllm_kvevict.config import build_config

        assert self.eviction is not None
        return build_config({**self.eviction, "budget": ANY_BUDGET})


def resolve_config(name: str) -> dict[str, Any]:
    """An eviction config by name: a path to a .yaml/.json config, a config
    shipped with the package (``kvevict policies`` and ``paths.shipped_configs``:
    ``momentkv``, ``adakv_snapkv``, ...), or the defaults of policy NAME."""
    from vllm_kvevict.config import KVEvictionConfigError, parse_config_source
    from vllm_kvevict.paths import shipped_config, shipped_configs
    from vllm_kvevict.policies import POLICIES

    path = Path(name)
    if not (path.suffix in (".yaml", ".yml", ".json") and path.is_file()):
        path = shipped_config(name)
    if path is not None:
        data = parse_config_source(str(path))
        if "policy" not in data:
            raise KVEvictionConfigError(f"{path} names no policy; add `policy: NAME`")
        return data
    if name not in POLICIES:
        raise KVEvictionConfigError(
            f"unknown policy or config {name!r}: give a policy ({', '.join(sorted(POLICIES))}), "
            f"a shipped config ({', '.join(shipped_configs())}) or a path to a .yaml/.json config"
        )
    return {"policy": name}


def eviction_options(source: str) -> dict[str, Any]:
    """``--kv-eviction-config JSON|FILE|NAME`` of `kvevict eval`, `bench` and
    `soak`: settings added to every eviction setting (inline JSON, a .json/.yaml
    file, or the name of a shipped config); KVEvictionConfigError naming the fix."""
    from vllm_kvevict.config import parse_config_source
    from vllm_kvevict.paths import shipped_config

    text = source.strip()
    if not text.startswith("{") and not Path(text).is_file():
        shipped = shipped_config(text)
        if shipped is not None:
            text = str(shipped)
    return parse_config_source(text)


def parse_setting(text: str, extra: dict[str, Any] | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> ServingSetting:
    """``full``, ``full-unbounded``, ``NAME=URL``, ``CONFIG@FRACTION`` (0 < FRACTION <= 1) or
    ``CONFIG@TOKENS`` (a budget, a multiple of the block size). ``extra`` options
    go into every eviction config (e.g. ``{"prefill_mode": "per_chunk"}``); the
    setting gives the budget, and a policy in ``extra`` must be the setting's.
    ``+prefix`` after ``full``, ``full-unbounded`` or CONFIG serves with vLLM's
    prefix caching on (``snapkv+prefix@0.25``: ``prefix_caching: shared``).
    ``+agnostic`` after CONFIG evicts query-agnostically, as KVzip and
    DefensiveKV report: the prompt's context is evicted once at its end, then
    the question is read (``snapkv+agnostic@0.2``; ``kvevict eval --engine
    reference`` only, which knows where each RULER question starts).
    ValueError naming the fix for anything the plugin would refuse at any budget."""
    text = text.strip()
    if text in (FULL, FULL + PREFIX):
        return ServingSetting(text, prefix_caching=text != FULL)
    if text in (FULL_UNBOUNDED, FULL_UNBOUNDED + PREFIX):
        return ServingSetting(text, unbounded=True, prefix_caching=text != FULL_UNBOUNDED)
    if "=" in text:
        name, url = text.split("=", 1)
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {text!r}: expected NAME=http://HOST:PORT")
        return ServingSetting(name, url=url.rstrip("/"))
    config, sep, amount_text = text.rpartition("@")
    if not sep or not config:
        raise ValueError(
            f"setting {text!r}: expected 'full', 'NAME=URL', 'CONFIG@FRACTION' or 'CONFIG@TOKENS'; "
            f"add what it keeps, e.g. {config or text}@0.25 (a quarter of the prompt) or "
            f"{config or text}@{16 * block_size} (tokens per KV head)"
        )
    try:
        amount = float(amount_text)
    except ValueError:
        raise ValueError(f"setting {text!r}: {amount_text!r} is neither a kept fraction "
                         "nor a budget in tokens") from None
    fraction = budget = None
    if not math.isfinite(amount):
        amount = -1.0  # refused below
    if 0 < amount <= 1:
        fraction = amount
    elif amount > 1 and amount == int(amount) and int(amount) % block_size == 0:
        budget = int(amount)
    else:
        raise ValueError(f"setting {text!r}: give a kept fraction in (0, 1] or a budget in "
                         f"tokens that is a multiple of {block_size}")
    query_agnostic = config.endswith(AGNOSTIC)
    if query_agnostic:
        config = config[: -len(AGNOSTIC)]
    prefix_caching = config.endswith(PREFIX)
    if prefix_caching:
        config = config[: -len(PREFIX)]
    if query_agnostic and (prefix_caching or config in (FULL, FULL_UNBOUNDED)):
        raise ValueError(f"setting {text!r}: {AGNOSTIC} goes after an eviction config without "
                         f"{PREFIX} (e.g. snapkv{AGNOSTIC}@0.2); the full cache reads the same either way")
    eviction = resolve_config(config)
    extra = dict(extra or {})
    if prefix_caching:
        extra["prefix_caching"] = "shared"
    if extra.get("policy", eviction["policy"]) != eviction["policy"]:
        raise ValueError(f"setting {text!r} serves policy {eviction['policy']!r}, and "
                         f"--kv-eviction-config names {extra['policy']!r}: drop its policy, "
                         "or name that policy in the setting")
    eviction = {**eviction, **extra}
    eviction.pop("budget", None)
    label = Path(config).stem if config.endswith((".yaml", ".yml", ".json")) else config
    label += PREFIX if prefix_caching else ""
    label += AGNOSTIC if query_agnostic else ""
    setting = ServingSetting(f"{label}@{amount:g}", eviction=eviction, fraction=fraction,
                             budget_tokens=budget, prefix_caching=eviction.get("prefix_caching") == "shared",
                             query_agnostic=query_agnostic)
    # Fail now on what is wrong at any budget; a budget that depends on the
    # prompt is checked by eviction_config once the prompts exist.
    if budget is not None:
        eviction_config(setting, 0.0, block_size, context=f"setting {text!r}")
    else:
        reason = _refusal({**eviction, "budget": ANY_BUDGET}, block_size)
        if reason is not None:
            raise ValueError(f"setting {text!r}: {reason}")
    return setting


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in a command line (``--x v`` or ``--x=v``), as
    argparse sees it: later flags win, so extra server args override ours."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def add_kv_eviction_config_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
    applies_to: str = "every eviction setting the tool serves",
    budget_from: str = "each setting",
    example: str = '{"prefill_mode": "per_chunk"}',
) -> None:
    """``--kv-eviction-config``, as ``kvevict eval``, ``bench`` and ``soak`` all take it."""
    parser.add_argument("--kv-eviction-config", default=None, metavar="JSON|FILE|NAME",
                        help=f"settings added to {applies_to}, as vllm serve's "
                        "--kv-eviction-config takes them (inline JSON, a .json/.yaml file or a "
                        "shipped config's name; `kvevict policies` lists them), e.g. "
                        f"'{example}'; the budget comes from {budget_from}")


def parse_settings(parser: argparse.ArgumentParser, specs: Sequence[str], options_source: str | None,
                   block_size: int = DEFAULT_BLOCK_SIZE, unbounded: bool = False,
                   served: bool = True) -> list[ServingSetting]:
    """The ``--setting`` specs of a command, with ``--kv-eviction-config``'s
    options in every eviction setting, each checked as far as it can be before
    the prompts exist; a mistake ends the command through ``parser.error``.
    ``unbounded``: the command sizes a pool for ``full-unbounded`` (bench).
    ``served``: the settings go to vLLM servers, which refuse a policy that
    only the reference decoder scores (kvzip)."""
    from vllm_kvevict.config import check_served

    try:
        options = eviction_options(options_source) if options_source else {}
        settings = [parse_setting(spec, options, block_size) for spec in specs]
        for setting in settings:
            if served and setting.eviction is not None:
                if setting.query_agnostic:
                    raise ValueError(f"setting {setting.name}: {AGNOSTIC} settings split each RULER "
                                     "prompt at its question, which --engine reference does; a server "
                                     f"reads the whole prompt (drop {AGNOSTIC} or add --engine reference)")
                try:
                    check_served(setting.config_at_any_budget())
                except ValueError as exc:
                    raise ValueError(f"setting {setting.name}: {exc}") from None
    except ValueError as exc:  # KVEvictionConfigError included
        parser.error(str(exc))
    if not unbounded and any(s.unbounded for s in settings):
        parser.error(f"{FULL_UNBOUNDED} is a `kvevict bench` setting (a KV pool for every request "
                     f"of its load); give '{FULL}' here")
    if options_source and not any(s.eviction is not None for s in settings):
        parser.error("--kv-eviction-config adds settings to eviction settings, and none is "
                     "given (full and NAME=URL take none): add one, e.g. --setting snapkv@512, "
                     "or drop --kv-eviction-config")
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        parser.error(f"settings must have distinct names, got {', '.join(names)}: "
                     "name running servers apart (NAME=URL)")
    return settings


def check_running_servers(parser: argparse.ArgumentParser, settings: Sequence[ServingSetting]) -> None:
    """Every ``NAME=URL`` setting answers ``/v1/models``; else ``parser.error``."""
    import requests

    from vllm_kvevict.evaluation.server import served_model

    for setting in settings:
        if setting.url is None:
            continue
        try:
            served_model(setting.url)
        except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            parser.error(f"setting {setting.name}: {setting.url} does not answer /v1/models "
                         f"({type(exc).__name__}: {reason[:200]}); start that server first or "
                         "drop the setting")


def _refusal(eviction: dict[str, Any], block_size: int) -> str | None:
    """Why the plugin's own checks refuse this config (None: accepted)."""
    from vllm_kvevict.config import KVEvictionConfigError, build_config

    try:
        build_config(eviction).check_block_size(block_size)
    except (KVEvictionConfigError, ValueError) as exc:
        return str(exc)
    return None


def minimum_budget(eviction: dict[str, Any], block_size: int = DEFAULT_BLOCK_SIZE,
                   limit: int = ANY_BUDGET) -> int | None:
    """The smallest whole-block budget the plugin accepts for this config."""
    for budget in range(block_size, limit + 1, block_size):
        if _refusal({**eviction, "budget": budget}, block_size) is None:
            return budget
    return None


def eviction_config(setting: ServingSetting, mean_prompt_tokens: float,
                    block_size: int = DEFAULT_BLOCK_SIZE, context: str = "") -> dict[str, Any] | None:
    """The setting's ``--kv-eviction-config`` at these prompts (None without
    eviction), validated; ValueError naming the smallest budget that works."""
    if setting.eviction is None:
        return None
    budget = setting.budget(mean_prompt_tokens, block_size)
    config = {**setting.eviction, "budget": budget}
    reason = _refusal(config, block_size)
    if reason is not None:
        smallest = minimum_budget(setting.eviction, block_size)
        hint = f"; this config needs at least {smallest} tokens" if smallest else ""
        fix = ("Give a budget the plugin accepts" if setting.fraction is None
               else "Keep a larger fraction or use longer prompts")
        raise ValueError(
            f"{context or setting.name}: budget {budget} tokens is refused ({reason}){hint}. {fix}."
        )
    return config


def pyplot():
    """matplotlib's pyplot on the file-only backend, or an error naming the install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'vllm-kvevict[eval]' "
                          "(or pip install matplotlib)") from None
    return plt
