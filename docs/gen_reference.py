"""Generate the pages of the API reference into docs/_build/src (then `mkdocs build`).

    python docs/gen_reference.py [--out DIR]

- one page per package: its README, its public API (mkdocstrings renders each module's
  ``__all__`` from the docstrings) and its changelog;
- ``config.md``: every key of titan-train's ``JobConfig``, read from the dataclasses
  (section, key, type, default as ``titan-train`` starts with, help from the field's
  docstring, the torchtitan spelling where it differs);
- ``cli.md``: the ``--help`` of every command and subcommand, as the commands print it.
Needs the five packages importable (the dev environment) for the config and the commands.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
SOURCE_URL = "https://github.com/titan-pretraining/titan/tree/main/"
PACKAGES = ("titan-dims", "titan-ckpt", "titan-optim", "titan-models", "titan-train")

# Each command and subcommand whose --help the CLI reference shows.
COMMANDS: dict[str, list[list[str]]] = {
    "titan-dims": [[], ["plan"]],
    "titan-ckpt": [[], ["inspect"], ["verify"], ["diff"], ["convert"]],
    "titan-train": [[], ["train"], ["config"], ["list-models"], ["generate"]],
}


def _link(match: re.Match[str], base: str) -> str:
    """A README's relative link, made absolute (the README's folders are not in the site)."""
    text, target = match.group(1), match.group(2)
    if re.match(r"^[a-z]+:|^#", target):
        return match.group(0)
    url = os.path.normpath(os.path.join(base, target)).replace(os.sep, "/")
    return f"[{text}]({SOURCE_URL}{url})"


def _markdown(path: Path, *, shift: int = 0) -> str:
    """A markdown file with links made absolute and headings moved down ``shift`` levels."""
    base = path.parent.relative_to(ROOT).as_posix()
    text = re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", lambda m: _link(m, base), path.read_text())
    if shift:
        text = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + shift) + " ", text, flags=re.M)
    return text


def api_modules(name: str) -> list[str]:
    """The modules whose ``__all__`` a package promises (titan-train has no top module)."""
    module = name.replace("-", "_")
    src = ROOT / "packages" / name / "src" / module
    if (src / "__init__.py").is_file():
        return [module]
    found = []
    for child in sorted(src.iterdir()):
        file = child if child.suffix == ".py" else child / "__init__.py"
        if file.is_file() and not child.name.startswith("_") and "__all__" in file.read_text():
            found.append(f"{module}.{child.stem if child.suffix == '.py' else child.name}")
    return found


def package_page(name: str) -> str:
    """README, then the public API, then the changelog of one package."""
    folder = ROOT / "packages" / name
    parts = [_markdown(folder / "README.md"), "\n## API reference\n"]
    for module in api_modules(name):
        parts.append(f"::: {module}\n")
    parts.append("\n## Changelog\n")
    changelog = _markdown(folder / "CHANGELOG.md", shift=1)
    parts.append(changelog.split("\n", 1)[1])  # without its own title
    return "\n".join(parts)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (the ``--help`` text), by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_rows(config: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every leaf key of a config dataclass tree."""
    rows = []
    docs = _field_docs(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            rows += config_rows(value, f"{key}.")
            continue
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        rows.append((key, kind, repr(value), docs.get(field.name, "")))
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_page(train_help: str) -> str:
    """Every TOML key of ``JobConfig``, section by section; ``train_help`` is the output of
    ``titan-train train --help``, to mark the keys that have no command-line flag."""
    from titan_train.compat import KEYS
    from titan_train.config import JobConfig

    # titan key -> the torchtitan names moved to it (July 2025 and later spellings).
    spellings: dict[str, list[str]] = {}
    for old, entry in KEYS.items():
        if entry.action == "move" and entry.to:
            spellings.setdefault(entry.to, []).append(f"not {old}" if entry.negate else old)
    torchtitan = {key: "`, `".join(names) for key, names in spellings.items()}
    job = JobConfig()
    lines = [
        "# Configuration reference",
        "",
        "Every setting of a `titan-train` run, generated from titan-train's `JobConfig`",
        "dataclasses. In a TOML file a key `section.key` is `key = value` under `[section]`",
        "(a nested key such as `parallelize.activation_checkpoint.mode` is",
        "`[parallelize.activation_checkpoint]`); on the command line it is",
        "`--section.key value`. Precedence: command line > TOML file > the defaults below,",
        "which are the ones `titan-train` starts with. Where torchtitan spells a key",
        "differently, its spelling is given; a torchtitan TOML using it loads unchanged.",
        "",
    ]
    for field in dataclasses.fields(job):
        section = getattr(job, field.name)
        doc = inspect.getdoc(type(section)) or ""
        lines += [f"## `[{field.name}]`", "", doc.split("\n\n")[0], ""]
        lines += ["| key | type | default | help |", "| --- | --- | --- | --- |"]
        for key, kind, default, help_ in config_rows(section, f"{field.name}."):
            if key in torchtitan:
                help_ += f" (torchtitan: `{torchtitan[key]}`)"
            if not re.search(rf"--{re.escape(key)}\b", train_help):
                help_ += " **TOML only**: no command-line flag."
            lines.append(f"| `{key}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(help_)} |")
        lines.append("")
    return "\n".join(lines)


def _help(command: str, sub: list[str]) -> str:
    exe = shutil.which(command)
    if exe is None:
        raise SystemExit(f"error: {command} is not on PATH; run in the dev environment")
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(
        [exe, *sub, "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0:
        raise SystemExit(f"error: `{command} {' '.join(sub)} --help` exited {done.returncode}")
    return done.stdout


def all_helps() -> dict[tuple[str, ...], str]:
    """The --help of every command, keyed by (command, *subcommand); run side by side, since
    each one imports torch."""
    calls = [(command, sub) for command, subs in COMMANDS.items() for sub in subs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        texts = pool.map(lambda call: _help(*call), calls)
    return {(command, *sub): text for (command, sub), text in zip(calls, texts, strict=True)}


def cli_page(helps: dict[tuple[str, ...], str]) -> str:
    """The --help of every command, verbatim."""
    lines = ["# Command reference", "", "Each command's `--help`, as it prints it.", ""]
    for command, subs in COMMANDS.items():
        lines += [f"## `{command}`", ""]
        for sub in subs:
            if sub:
                lines += [f"### `{command} {' '.join(sub)}`", ""]
            lines += ["```text", helps[(command, *sub)].rstrip(), "```", ""]
    return "\n".join(lines)


def index_page() -> str:
    readme = _markdown(ROOT / "README.md")
    pages = "\n".join(f"- [{name}](packages/{name}.md)" for name in PACKAGES)
    return (
        f"{readme}\n\n## This reference\n\n{pages}\n"
        "- [Configuration](config.md): every key of `titan-train`'s TOML and command line\n"
        "- [Commands](cli.md): `titan-dims`, `titan-ckpt` and `titan-train`\n"
    )


def generate(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    (out / "packages").mkdir(parents=True)
    (out / "index.md").write_text(index_page())
    for name in PACKAGES:
        (out / "packages" / f"{name}.md").write_text(package_page(name))
    helps = all_helps()
    (out / "config.md").write_text(config_page(helps[("titan-train", "train")]))
    (out / "cli.md").write_text(cli_page(helps))
    print(f"wrote the reference pages to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "src")
    generate(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
