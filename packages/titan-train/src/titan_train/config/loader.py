"""Load a config dataclass tree: the command line over the TOML file (over the files it
``extends``) over the defaults. TOML is checked strictly before anything runs: an unknown
key, a wrong type, a number outside 64 bits or a value a section refuses is one
``ConfigError`` naming file, key, value and what is allowed. The command line goes through
``tyro`` (``--help`` with every option, docstrings as plain text); list options also take
one comma-separated value (``--x.names a,b``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from titan_train.errors import ConfigError

__all__ = [
    "ConfigError",
    "check_int_ranges",
    "check_type",
    "load_config",
    "pop_options",
    "read_toml",
    "to_dict",
]

T = TypeVar("T")
EXTENDS_KEY = "extends"
"""A top-level TOML key naming a base file (relative to this one) whose values this file
overrides."""


def read_toml(path: str | Path, *, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML file, merged over the base files it ``extends``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist (or is not a file).")
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise ConfigError(f"Config files extend each other in a loop: {chain}.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}.") from None
    base = data.pop(EXTENDS_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: '{EXTENDS_KEY}' must be a file name, got {base!r}.")
    merged = read_toml(resolved.parent / base, _seen=(*_seen, resolved))
    return _deep_merge(merged, data)


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    config_file_flag: str = "--job.config_file",
    prog: str | None = None,
    description: str | None = None,
    translate: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
    preset: tuple[str, Mapping[str, Any]] | None = None,
) -> T:
    """``cls`` from defaults, the TOML file of ``config_file_flag`` or ``preset`` ``(name,
    values)`` through ``translate(values, source)``, then ``--section.key value`` options."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = _find_flag(argv, config_file_flag)
    if preset is not None and config_file:
        raise ConfigError(
            f"{config_file_flag} {config_file} and {preset[0]} both give the settings to start "
            f"from; keep one (override either with --section.key options)."
        )
    source = preset[0] if preset else config_file or "defaults"
    values = dict(preset[1]) if preset else read_toml(config_file) if config_file else {}
    if translate is not None:
        values = translate(values, source)
    default = from_dict(cls, values, source=source)
    argv = split_commas(argv, list_options(cls))

    with _plain_docstrings():
        config = tyro.cli(
            cls,
            default=default,
            args=argv,
            prog=prog,
            description=description and _RST_LITERAL.sub("", description),
            use_underscores=True,
        )
    # tyro reads any whole number; the file's were checked in from_dict, so what is out of
    # range here came from the command line.
    check_int_ranges(config, source="command line")
    return config


INT64 = (-(2**63), 2**63 - 1)
"""The whole numbers a config field may hold: a C/torch int64 (and a TOML integer). A value
past it would pass every section's check and fail deep in a run, in torch or in C code."""


def _check_int_range(value: Any, *, source: str, where: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        low, high = INT64
        if not low <= value <= high:
            raise ConfigError(
                f"{source}: {where}={value} is not allowed; a whole number here must be in "
                f"[{low}, {high}] (a 64-bit integer: -2**63 .. 2**63 - 1)."
            )


def check_int_ranges(config: Any, *, source: str, prefix: str = "") -> None:
    """Check every whole number in the dataclass tree ``config`` (lists included) against
    ``INT64``: one rule for every int field, whichever package's section declares it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        where = f"{prefix}{f.name}"
        for item in value if isinstance(value, list | tuple) else (value,):
            if dataclasses.is_dataclass(item):
                check_int_ranges(item, source=source, prefix=f"{where}.")
            else:
                _check_int_range(item, source=source, where=where)


def list_options(cls: type, prefix: str = "--") -> set[str]:
    """The command-line flags of ``cls`` (a dataclass tree) whose values are lists or tuples
    of plain values (str, int, float)."""
    flags: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            flags |= list_options(hint, f"{prefix}{f.name}.")
            continue
        options = typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,)
        for option in options:
            items = typing.get_args(option)
            if typing.get_origin(option) in (list, tuple) and items and items[0] in _PLAIN:
                flags.add(f"{prefix}{f.name}")
    return flags


_UNIONS = (typing.Union, types.UnionType)
_PLAIN = (str, int, float)


def split_commas(argv: Sequence[str], flags: set[str]) -> list[str]:
    """``argv`` with each value of a list flag split at commas, as torchtitan's command line
    reads lists: ``--checkpoint.exclude_from_loading a,b`` is ``... a b``."""
    out: list[str] = []
    in_list = False
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            in_list = _normal_flag(name) in flags
            if in_list and eq:
                out.extend([name, *(v for v in value.split(",") if v)])
                in_list = False
                continue
            out.append(arg)
        elif in_list and "," in arg:
            out.extend(v for v in arg.split(",") if v)
        else:
            out.append(arg)
    return out


def pop_options(
    argv: Sequence[str], wanted: Callable[[str], bool], example: str
) -> tuple[list[str], list[tuple[str, str]]]:
    """Take ``--name value`` / ``--name=value`` options whose name ``wanted`` accepts out of
    ``argv``: ``(the rest, [(name, value)])``; ``example`` shows a missing value's fix."""
    rest: list[str] = []
    found: list[tuple[str, str]] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        key = _normal_flag(name)[2:] if name.startswith("--") else ""
        if not key or not wanted(key):
            rest.append(arg)
            continue
        if not eq:
            value = next(it, None)  # type: ignore[assignment]
            if value is None or value.startswith("--"):
                raise ConfigError(f"{name} needs a value, e.g. {example}.")
        found.append((key, value))
    return rest, found


def _normal_flag(name: str) -> str:
    """A flag with underscores for dashes after ``--`` (tyro accepts either spelling)."""
    return "--" + name[2:].replace("-", "_")


_RST_LITERAL = re.compile(r"``")


@contextlib.contextmanager
def _plain_docstrings() -> Iterator[None]:
    """Help as plain text, each paragraph's lines joined, by hooking tyro's private line
    joiner (it keeps a break before a line starting with a backtick or a digit)."""
    from tyro import _strings

    original = getattr(_strings, "remove_single_line_breaks", None)
    if original is None:  # another tyro layout: help shows the docstrings as written
        yield
        return

    def plain(text: str) -> str:
        # Join the lines of each paragraph; keep blank lines and list items ("- ...").
        out: list[str] = []
        for line in (raw.strip() for raw in _RST_LITERAL.sub("", text).split("\n")):
            if out and out[-1] and line and not line.startswith(("- ", "* ")):
                out[-1] = f"{out[-1]} {line}"
            else:
                out.append(line)
        return original("\n".join(out))

    _strings.remove_single_line_breaks = plain
    try:
        yield
    finally:
        _strings.remove_single_line_breaks = original


def from_dict(
    cls: type[T], values: Mapping[str, Any], *, source: str, prefix: str = "", base: T | None = None
) -> T:
    """Dataclass ``cls`` from nested ``values``, every key and type checked; unset keys keep
    ``base``'s value (a section's default as its parent declares it), else the class's."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(_unknown_key_message(source, prefix, key, sorted(known)))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: [{where}] must be a table of keys, got {value!r}.")
            default = getattr(base, key) if base is not None else _declared_default(known[key])
            kwargs[key] = from_dict(hint, value, source=source, prefix=f"{where}.", base=default)
        else:
            kwargs[key] = check_type(value, hint, source=source, where=where)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: {error}") from None


def _declared_default(f: dataclasses.Field) -> Any:
    """A field's default as declared (``JobConfig.checkpoint`` sets its own interval), or
    ``None`` when it has none."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass tree as plain TOML-ready values (``None`` entries and empty tables
    dropped)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, list | tuple):
            out[f.name] = [to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif value is not None and value != {}:
            out[f.name] = value
    return out


def check_type(value: Any, hint: Any, *, source: str, where: str) -> Any:
    """``value`` checked against ``hint`` (unions, ``Literal``, lists, tuples, dataclass tables,
    ints as floats); ``ConfigError`` naming ``source`` and ``where``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return check_type(value, option, source=source, where=where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is typing.Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{source}: {where} = {value!r} is not one of {allowed}.")
        return value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {where} must be a list, got {value!r}.")
        item = args[0] if args else Any
        checked = [
            check_type(v, item, source=source, where=f"{where}[{i}]") for i, v in enumerate(value)
        ]
        return tuple(checked) if origin is tuple or hint is tuple else checked
    if hint is Any:
        return value
    _check_int_range(value, source=source, where=where)
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return from_dict(hint, value, source=source, prefix=f"{where}.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {where} must be true or false, got {value!r}.")
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{source}: {where} must be a number, got {value!r}.")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(
            f"{source}: {where} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})."
        )
    return value


def _type_name(hint: type) -> str:
    return {int: "a whole number", float: "a number", str: "a string"}.get(hint, hint.__name__)


def _unknown_key_message(source: str, prefix: str, key: str, known: list[str]) -> str:
    what = "section" if not prefix else "key"
    where = f"{prefix}{key}"
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {prefix}{close[0]}?" if close else ""
    scope = f"[{prefix.rstrip('.')}]" if prefix else "the file"
    return f"{source}: unknown {what} {where!r}.{hint} Allowed in {scope}: {', '.join(known)}."


def _find_flag(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), left in place so
    that the command line still shows it (tyro accepts it as an ordinary field)."""
    for i, raw in enumerate(argv):
        name, eq, value = raw.partition("=")
        arg = _normal_flag(name) + eq + value if name.startswith("--") else raw
        if arg == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a file name.")
            return argv[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged
