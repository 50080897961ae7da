"""Write the merged config back as TOML (the standard library reads TOML but cannot write it).

Handles what config sections hold: strings, numbers, booleans, lists of those or of tables,
and nested tables. The output reads back with ``tomllib`` to the same values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps"]


def dumps(data: Mapping[str, Any]) -> str:
    """``data`` as a TOML document: plain keys first, then one ``[table]`` per mapping."""
    return _table(data, prefix="").lstrip("\n")


def _table(data: Mapping[str, Any], prefix: str) -> str:
    lines = []
    tables = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_value(value)}")
    out = ""
    if prefix:
        out += f"\n[{prefix}]\n"
    out += "".join(f"{line}\n" for line in lines)
    for key, value in tables:
        out += _table(value, f"{prefix}.{key}" if prefix else key)
    return out


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is JSON-escaped text in quotes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")
