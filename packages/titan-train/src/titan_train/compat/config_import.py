"""``titan-train config import``: a torchtitan 2026 configuration as a titan TOML file.

    titan-train config import --torchtitan-module llama3 --config llama3_debugmodel
    titan-train config import --torchtitan-module qwen3 --config qwen3_0_6b -o qwen3.toml
    titan-train --job.config_file qwen3.toml            # trains what --module/--config would

The file holds every setting torchtitan's function makes (``titan_train.compat.head``),
in titan's keys, plus any option given after it; it loads to the config that ``titan-train
--module M --config F`` runs. What is not carried is listed in the file's header and on
stderr. An existing file is kept unless ``--force``. Nothing of torchtitan is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from titan_train import compat
from titan_train.compat import head as torchtitan_head
from titan_train.errors import ConfigError

__all__ = ["run_config_import"]

HELP = __doc__ or ""

_BATCH_KEYS = (
    "training.local_batch_size",
    "training.global_batch_size",
    "pipeline.microbatch_size",
    "validation.seq_len",
    "validation.local_batch_size",
)


def run_config_import(argv: list[str]) -> int:
    """Write (or print) the TOML of ``--torchtitan-module M --config F``; returns the exit
    status. Raises ``ConfigError`` for a bad command line or configuration."""
    from titan_train.config import JobConfig, parse_job_config
    from titan_train.config.model_args import build_model_args
    from titan_train.config.registry import load_model_spec
    from titan_train.config.toml_writer import dumps

    if {"-h", "--help"} & set(argv):
        print(HELP.replace("``", ""))
        return 0
    options, rest = _options(argv)
    module, name = options.get("torchtitan-module"), options.get("config")
    if not module or not name:
        raise ConfigError(
            "config import needs --torchtitan-module and --config, e.g. --torchtitan-module "
            "llama3 --config llama3_debugmodel."
        )
    output = options.get("output")
    if output and os.path.exists(output) and "force" not in options:
        raise ConfigError(f"{output} exists; pass --force to overwrite it, or another --output.")
    flat, notes = torchtitan_head.preset_values(module, name)
    config = parse_job_config(
        ["--module", module, "--config", name, *rest], prog="titan-train config import"
    )
    spec = load_model_spec(config.model.name)  # model.args checked as a run checks them
    build_model_args(spec, config.model, vocab_size=None, max_seq_len=config.training.seq_len)
    table = compat.flatten(compat.translate(compat.unflatten(flat), defaults={}).values)
    resolved = compat.flatten(config.to_dict())
    defaults = compat.flatten(JobConfig().to_dict())
    keys = set(table) | set(_BATCH_KEYS) | {k for k, v in resolved.items() if defaults.get(k) != v}
    values = compat.unflatten({k: v for k, v in resolved.items() if k in keys})
    source = f"torchtitan's {module}.{name} (torchtitan {torchtitan_head.HEAD_COMMIT})"
    header = [f"# {source}, as titan settings (titan-train config import).", "# Not carried:"]
    header += [f"#   - {note}" for note in notes] or ["#   nothing"]
    text = "\n".join(header) + "\n\n" + dumps(_ordered(values))
    if not output:
        print(text, end="")
        return 0
    with open(output, "w", encoding="utf-8") as f:
        f.write(text)
    print(
        f"wrote {output}: {source}; train it with titan-train --job.config_file {output}. "
        f"Not carried: {'; '.join(notes) or 'nothing'}.",
        file=sys.stderr,
    )
    return 0


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """This command's own options (``--torchtitan-module``, ``--config``, ``--output``/``-o``,
    ``--force``) and the rest (train's options, passed on)."""
    own = {"--torchtitan-module", "--torchtitan_module", "--config", "--output", "-o"}
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        i += 1
        if name == "--force":
            found["force"] = ""
            continue
        if name not in own:
            rest.append(argv[i - 1])
            continue
        if not eq:
            if i >= len(argv):
                raise ConfigError(f"{name} needs a value.")
            value = argv[i]
            i += 1
        key = "output" if name == "-o" else name[2:].replace("_", "-")
        found[key] = value
    return found, rest


def _ordered(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with its sections in ``JobConfig``'s order, as ``config --print`` shows."""
    from titan_train.config import JobConfig

    order = list(JobConfig().to_dict())
    return {k: values[k] for k in sorted(values, key=lambda k: order.index(k))}
