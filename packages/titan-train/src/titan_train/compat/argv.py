"""torchtitan's command lines: the spellings of the keys of ``titan_train.compat.KEYS``,
taken out of a command line before titan's own parser sees it, as a nested dict for
``compat.translate(..., cli_values=...)``; and torchtitan 2026's ``--module M --config F``
(``pop_preset``), which name a configuration of ``titan_train.compat.head``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from titan_train.compat import KEYS, Key, lookup, unflatten
from titan_train.config.loader import ConfigError, pop_options

__all__ = ["pop_preset", "split_argv"]


def split_argv(argv: Iterable[str]) -> tuple[list[str], dict[str, Any]]:
    """Take torchtitan keys, in any of its spellings (dashes, ``--x.no-key``, ``=value``, comma
    lists), out of a command line: ``(the rest, their values as a nested dict)``."""
    args = list(argv)
    rest: list[str] = []
    found: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        name, eq, inline = arg.partition("=")
        path, key, negated = _cli_key(name)
        if key is None:
            rest.append(arg)
            continue
        values: list[str] = [inline] if eq else []
        while not eq and i < len(args) and _takes(key, args[i], values):
            values.append(args[i])
            i += 1
        found[path] = _cli_value(arg, key, values, negated)
    return rest, unflatten(found)


def _takes(key: Key, arg: str, values: list[str]) -> bool:
    """Whether ``arg`` is one more value of a torchtitan flag: a list takes words up to the
    next option, a boolean an explicit true/false, other keys one word."""
    if arg.startswith("--"):
        return False
    if key.kind is list:
        return True
    if key.kind is bool:
        return not values and arg.lower() in ("true", "false")
    return not values


def _cli_key(name: str) -> tuple[str, Key | None, bool]:
    if not name.startswith("--"):
        return name, None, False
    if "." not in name:  # torchtitan 2026's top-level keys: --hf_assets_path, --dump_folder
        path = name[2:].replace("-", "_")
        return path, KEYS.get(path), False
    section, _, field = name[2:].replace("-", "_").partition(".")
    path = f"{section}.{field}"
    key = lookup(path)
    if key is not None:
        return path, key, False
    last = field.rpartition(".")
    if last[2].startswith("no_"):
        positive = f"{section}.{last[0] + '.' if last[0] else ''}{last[2][3:]}"
        key = lookup(positive)
        if key is not None and (key.kind is bool or key.action == "noop"):
            return positive, key, True
    return path, None, False


def _cli_value(arg: str, key: Key, values: list[str], negated: bool) -> Any:
    if key.action == "noop":  # ignored whatever it says; kept only to be named in the log
        return values[0] if len(values) == 1 else (values or not negated)
    if key.kind is bool:
        if negated and values:
            raise ConfigError(f"{arg} takes no value.")
        if not values:
            return not negated
        word = values[0].lower()
        if len(values) > 1 or word not in ("true", "false"):
            raise ConfigError(f"{arg} needs true or false (or no value), got {values}.")
        return word == "true"
    if key.kind is list:
        return [item for v in values for item in v.split(",") if item]
    if len(values) != 1:
        raise ConfigError(f"{arg} needs one value, got {len(values)}.")
    try:
        return key.kind(values[0])
    except ValueError:
        raise ConfigError(f"{arg} needs {key.kind.__name__} value, got {values[0]!r}.") from None


def pop_preset(argv: Sequence[str]) -> tuple[list[str], tuple[str, str] | None]:
    """Take ``--module M --config F`` out of ``argv``: ``(the rest, (M, F) or None)``; one
    without the other is refused, as torchtitan refuses it."""
    example = "--module llama3 --config llama3_debugmodel"
    rest, options = pop_options(argv, lambda key: key in ("module", "config"), example)
    found = dict(options)
    if not found:
        return rest, None
    if len(found) == 1:
        missing = "--config" if "module" in found else "--module"
        raise ConfigError(
            f"{missing} is missing: torchtitan's configurations are named by both, e.g. "
            "--module llama3 --config llama3_debugmodel."
        )
    return rest, (found["module"], found["config"])
