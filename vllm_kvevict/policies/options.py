"""Policy options checked against the policy's own field types, once, when a
config is built: a wrong type (``kernel_size: 7.0``, ``seed: "x"``), an
unknown name or a value the policy refuses is one line naming the fix, never
an error at the first eviction."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


def option_fields(cls: type) -> dict[str, Any]:
    """The options a policy class accepts, with their defaults."""
    return {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)
    }


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is dict or hint is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this module does not know: the policy checks it


def build_with_options(cls: type, name: str, options: dict[str, Any] | None) -> Any:
    """``cls(**options)`` after checking names and types; ``ValueError`` with
    one line naming the fix for anything wrong, including what the policy's
    own checks refuse."""
    options = dict(options or {})
    accepted = option_fields(cls)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = ", ".join(sorted(accepted)) or "none"
        raise ValueError(
            f"policy {name!r} has no option {', '.join(map(repr, unknown))}; its options are: {hint}"
        )
    hints = typing.get_type_hints(cls)
    for key, value in options.items():
        if not _conforms(value, hints[key]):
            raise ValueError(
                f"policy {name!r} option {key!r} must be {_describe(hints[key])}, got {value!r}"
            )
        if hints[key] is float:
            options[key] = float(value)
    try:
        return cls(**options)
    except TypeError as exc:  # a policy's own construction, e.g. a base's options
        raise ValueError(f"policy {name!r}: {exc}") from None
