"""The public-API guard: a stored snapshot of each package's public surface, compared with the tree.

    python tools/release/api.py check      # CI: fails on a breaking change without a version bump
    python tools/release/api.py snapshot   # refresh tools/release/api/*.json (review the diff)

The public surface of a package is every name its ``__all__`` exports, with signatures: a
function's parameters (name, kind, annotation, default), a class's bases, constructor and
public members, an attribute's annotation and value. titan-train has no top-level module, so
its surface is the ``__all__`` of each of its top-level modules (``titan_train.config``...).
The surface is read statically with griffe: nothing is imported.

A change is *breaking* when code written against the snapshot may stop working: a name or
member removed, a kind changed, a parameter removed, renamed, moved, made required or given
a new default, a new required parameter, a base class dropped, a constant's value changed.
Anything else that differs is an *addition* and passes. A breaking change passes only when
the package's version is a breaking bump over the snapshot's (0.x: a new minor; from 1.0: a
new major); the check then asks for a refreshed snapshot, so the next change is compared
with the new API.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import griffe
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Package, breaking_bump, packages

SNAPSHOTS = Path(__file__).resolve().parent / "api"
_SKIP = {"__version__"}  # changes with every release by design


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _params(obj: Any) -> list[list[str | None]]:
    return [[p.name, p.kind.value, _text(p.annotation), _text(p.default)] for p in obj.parameters]


def _entry(obj: Any) -> dict[str, Any]:
    """The signature of one object, as plain JSON values."""
    if obj.is_function:
        return {"kind": "function", "params": _params(obj), "returns": _text(obj.returns)}
    if obj.is_class:
        return {"kind": "class", "bases": [str(b) for b in obj.bases], "params": _params(obj)}
    if obj.is_attribute:
        entry = {"kind": "attribute", "annotation": _text(obj.annotation)}
        if obj.parent is not None and obj.parent.is_module:  # a constant: its value is API
            entry["value"] = _text(obj.value)
        return entry
    return {"kind": obj.kind.value}


def _walk(obj: Any, path: str, out: dict[str, dict[str, Any]]) -> None:
    """Record ``obj`` at ``path``, then the public members of a class or exported module."""
    try:
        obj = obj.final_target if obj.is_alias else obj
    except griffe.AliasResolutionError:  # re-exported from outside titan: name only
        out[path] = {"kind": "external", "target": obj.target_path}
        return
    out[path] = _entry(obj)
    if obj.is_class:
        for name, member in obj.members.items():
            if not name.startswith("_") and not member.is_alias:
                _walk(member, f"{path}.{name}", out)
    elif obj.is_module and obj.exports is not None:
        for name in obj.exports:
            if name not in _SKIP and name in obj.members:
                _walk(obj.members[name], f"{path}.{name}", out)


def surface_modules(pkg: Package) -> list[str]:
    """The modules whose ``__all__`` make up ``pkg``'s public surface."""
    src = pkg.folder / "src" / pkg.module
    if (src / "__init__.py").is_file():
        return [pkg.module]
    # A namespace package (titan-train): each public top-level module or subpackage.
    found = []
    for child in sorted(src.iterdir()):
        name = child.stem if child.suffix == ".py" else child.name
        is_module = child.suffix == ".py" or (child / "__init__.py").is_file()
        if is_module and not name.startswith("_"):
            found.append(f"{pkg.module}.{name}")
    return found


def surface(pkg: Package, root: Path) -> dict[str, dict[str, Any]]:
    """The public surface of ``pkg`` in the tree at ``root``: dotted path -> signature."""
    paths = [str(p.folder / "src") for p in packages(root)]
    loader = griffe.GriffeLoader(search_paths=paths, docstring_parser=None)
    top = loader.load(pkg.module)
    loader.resolve_aliases(implicit=False, external=None)
    out: dict[str, dict[str, Any]] = {}
    for dotted in surface_modules(pkg):
        module = top if dotted == pkg.module else top[dotted.removeprefix(pkg.module + ".")]
        if module.exports is None:
            continue  # no __all__: nothing promised
        for name in module.exports:
            if name not in _SKIP and name in module.members:
                _walk(module.members[name], f"{dotted}.{name}", out)
    return dict(sorted(out.items()))


def _compare_params(path: str, old: list, new: list) -> list[str]:
    """Why a call written against ``old`` may fail or behave differently with ``new``."""
    problems = []
    var = ("variadic positional", "variadic keyword")
    positional = ("positional-only", "positional or keyword")
    by_keyword = ("positional or keyword", "keyword-only")
    new_by_name = {p[0]: (i, p) for i, p in enumerate(new)}
    for index, (name, kind, _ann, default) in enumerate(old):
        if kind in var:
            if not any(p[1] == kind for p in new):
                stars = "*" if kind == var[0] else "**"
                problems.append(f"{path}: no longer accepts {stars}{name}")
            continue
        if name not in new_by_name:
            problems.append(f"{path}: parameter {name!r} removed")
            continue
        new_index, (_, new_kind, _, new_default) = new_by_name[name]
        if kind in positional and (new_kind not in positional or new_index != index):
            problems.append(f"{path}: parameter {name!r} no longer at position {index}")
        if kind in by_keyword and new_kind not in by_keyword:
            problems.append(f"{path}: parameter {name!r} can no longer be passed by keyword")
        if default is not None and new_default is None:
            problems.append(f"{path}: parameter {name!r} is now required")
        elif default is not None and new_default != default:
            problems.append(f"{path}: default of {name!r} changed from {default} to {new_default}")
    old_names = {p[0] for p in old}
    for name, kind, _ann, default in new:
        if name not in old_names and kind not in var and default is None:
            problems.append(f"{path}: new required parameter {name!r}")
    return problems


def compare(old: dict[str, dict], new: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(breaking changes, compatible additions) from surface ``old`` to ``new``."""
    breaking, additions = [], []
    for path, was in old.items():
        now = new.get(path)
        if now is None:
            breaking.append(f"{path}: removed")
        elif was["kind"] != now["kind"]:
            breaking.append(f"{path}: was a {was['kind']}, now a {now['kind']}")
        else:
            if "params" in was:
                breaking += _compare_params(path, was["params"], now["params"])
            for base in set(was.get("bases", [])) - set(now.get("bases", [])):
                breaking.append(f"{path}: no longer a subclass of {base}")
            if "value" in was and was["value"] != now.get("value"):
                breaking.append(f"{path}: value changed from {was['value']} to {now['value']}")
            if was != now and not breaking_for(path, breaking):
                additions.append(f"{path}: signature extended")
    additions += [f"{path}: added" for path in new if path not in old]
    return breaking, additions


def breaking_for(path: str, breaking: list[str]) -> bool:
    return any(line.startswith(f"{path}:") for line in breaking)


def snapshot_file(pkg: Package, folder: Path) -> Path:
    return folder / f"{pkg.name}.json"


def write_snapshots(root: Path, folder: Path) -> None:
    """Store the surface of every package in ``folder`` (one JSON file each)."""
    folder.mkdir(parents=True, exist_ok=True)
    for pkg in packages(root):
        entries = surface(pkg, root)
        # One entry per line: a reviewer reads an API change as a one-line diff.
        lines = [f"  {json.dumps(path)}: {json.dumps(entry)}" for path, entry in entries.items()]
        head = f'{{\n "package": "{pkg.name}",\n "version": "{pkg.version}",\n "surface": {{\n'
        snapshot_file(pkg, folder).write_text(head + ",\n".join(lines) + "\n }\n}\n")
        print(f"wrote {snapshot_file(pkg, folder)} ({len(entries)} entries)")


def check(root: Path, folder: Path) -> int:
    """Compare every package with its snapshot; 1 on an unversioned breaking change."""
    failed = stale = False
    for pkg in packages(root):
        file = snapshot_file(pkg, folder)
        if not file.is_file():
            print(f"error: {pkg.name}: no API snapshot {file}; run `hatch run api-snapshot`")
            failed = True
            continue
        stored = json.loads(file.read_text())
        old_version, version = Version(stored["version"]), pkg.version
        breaking, additions = compare(stored["surface"], surface(pkg, root))
        bumped = breaking_bump(old_version, version)
        for line in breaking:
            print(f"{'note' if bumped else 'error'}: {pkg.name}: breaking: {line}")
        for line in additions:
            print(f"note: {pkg.name}: compatible: {line}")
        if breaking and not bumped:
            failed = True
            print(
                f"error: {pkg.name} {version} breaks the API of {old_version} (above) without "
                f"a breaking version bump. Either keep the old API, or bump the version "
                f"(0.x: to {old_version.major}.{old_version.minor + 1}.0) with a CHANGELOG "
                f"entry, or, if {pkg.name}-v{old_version} was never published, accept the "
                f"change with `hatch run api-snapshot` and commit the snapshot. See RELEASING.md."
            )
        elif breaking or additions or old_version != version:
            stale = True
        if not breaking:
            print(f"ok: {pkg.name} {version}: no breaking change since the snapshot")
    if stale and not failed:
        print("note: the snapshots are behind the tree; refresh with `hatch run api-snapshot`")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "snapshot", "show"])
    parser.add_argument("--root", type=Path, default=ROOT, help="monorepo root (default: this one)")
    parser.add_argument(
        "--snapshots", type=Path, default=SNAPSHOTS, help=f"snapshot folder (default {SNAPSHOTS})"
    )
    parser.add_argument("--package", help="with show: one package's surface")
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        write_snapshots(args.root, args.snapshots)
        return 0
    if args.command == "show":
        for pkg in packages(args.root):
            if args.package in (None, pkg.name):
                for path, entry in surface(pkg, args.root).items():
                    print(path, json.dumps(entry))
        return 0
    return check(args.root, args.snapshots)


if __name__ == "__main__":
    sys.exit(main())
