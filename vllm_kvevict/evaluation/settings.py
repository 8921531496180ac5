"""What `kvevict eval` and `kvevict bench` compare: serving settings.

A setting is the full cache (``full``), an eviction config kept at a fraction
of the prompt or at a fixed budget (``snapkv@0.25``, ``configs/momentkv.yaml@0.5``,
``tova@1024``; the tools start the server), or a server that already runs
(``NAME=URL``). Budgets are checked with the plugin's own config rules before
any server starts, so a setting vLLM would refuse fails at once, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL = "full"
DEFAULT_BLOCK_SIZE = 32
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ServingSetting:
    """One row of a report."""

    name: str
    url: str | None = None  # a running server
    eviction: dict[str, Any] | None = None  # the config without "budget"; None: no eviction
    fraction: float | None = None  # budget = fraction x mean prompt tokens, or
    budget_tokens: int | None = None  # a fixed budget

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


def resolve_config(name: str) -> dict[str, Any]:
    """An eviction config by name: a .yaml/.json path, ``configs/NAME.yaml`` (in the
    current directory or this repository), or the defaults of policy NAME."""
    from vllm_kvevict.config import KVEvictionConfigError, parse_config_source
    from vllm_kvevict.policies import POLICIES

    for path in (Path(name), Path("configs") / f"{name}.yaml", REPO_ROOT / "configs" / f"{name}.yaml"):
        if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
            data = parse_config_source(str(path))
            if "policy" not in data:
                raise KVEvictionConfigError(f"{path} names no policy; add `policy: NAME`")
            return data
    if name not in POLICIES:
        raise KVEvictionConfigError(
            f"unknown policy or config {name!r}: give a policy ({', '.join(sorted(POLICIES))}), "
            "a configs/NAME.yaml name, or a path to a .yaml/.json config"
        )
    return {"policy": name}


def parse_setting(text: str, extra: dict[str, Any] | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> ServingSetting:
    """``full``, ``NAME=URL``, ``CONFIG@FRACTION`` (0 < FRACTION <= 1) or
    ``CONFIG@TOKENS`` (a budget, a multiple of the block size). ``extra`` options
    go into every eviction config (e.g. ``{"prefill_mode": "per_chunk"}``)."""
    text = text.strip()
    if text == FULL:
        return ServingSetting(FULL)
    if "=" in text:
        name, url = text.split("=", 1)
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {text!r}: expected NAME=http://HOST:PORT")
        return ServingSetting(name, url=url.rstrip("/"))
    config, sep, amount_text = text.rpartition("@")
    if not sep or not config:
        raise ValueError(
            f"setting {text!r}: expected 'full', 'NAME=URL' or 'POLICY@FRACTION' (e.g. snapkv@0.25)"
        )
    try:
        amount = float(amount_text)
    except ValueError:
        raise ValueError(f"setting {text!r}: {amount_text!r} is neither a kept fraction "
                         "nor a budget in tokens") from None
    fraction = budget = None
    if 0 < amount <= 1:
        fraction = amount
    elif amount > 1 and amount == int(amount) and int(amount) % block_size == 0:
        budget = int(amount)
    else:
        raise ValueError(f"setting {text!r}: give a kept fraction in (0, 1] or a budget in "
                         f"tokens that is a multiple of {block_size}")
    eviction = {**resolve_config(config), **(extra or {})}
    eviction.pop("budget", None)
    label = Path(config).stem if config.endswith((".yaml", ".yml", ".json")) else config
    setting = ServingSetting(f"{label}@{amount:g}", eviction=eviction, fraction=fraction,
                             budget_tokens=budget)
    # Fail now on what is wrong at any budget; a budget that depends on the
    # prompt is checked by eviction_config once the prompts exist.
    if budget is not None:
        eviction_config(setting, 0.0, block_size, context=f"setting {text!r}")
    else:
        reason = _refusal({**eviction, "budget": 1 << 16}, block_size)
        if reason is not None:
            raise ValueError(f"setting {text!r}: {reason}")
    return setting


def _refusal(eviction: dict[str, Any], block_size: int) -> str | None:
    """Why the plugin's own checks refuse this config (None: accepted)."""
    from vllm_kvevict.config import KVEvictionConfigError, build_config

    try:
        build_config(eviction).check_block_size(block_size)
    except (KVEvictionConfigError, ValueError) as exc:
        return str(exc)
    return None


def minimum_budget(eviction: dict[str, Any], block_size: int = DEFAULT_BLOCK_SIZE,
                   limit: int = 1 << 16) -> int | None:
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
        raise ValueError(
            f"{context or setting.name}: budget {budget} tokens is refused ({reason}){hint}. "
            "Keep a larger fraction or use longer prompts."
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
