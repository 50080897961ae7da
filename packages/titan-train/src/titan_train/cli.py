"""The ``titan-train`` command.

    titan-train                                   # train the Llama 3 debug model, embedded data
    titan-train train --job.config_file run.toml --training.steps 100
    titan-train --nproc-per-node 2 --parallelism.data_parallel_shard_degree 2
    titan-train config --print [--job.config_file run.toml ...]   # the merged config as TOML
    titan-train list-models

``--nproc-per-node N`` (with N > 1, outside torchrun) starts N processes through
``torch.distributed.run`` on this machine; under torchrun or SLURM-launched torchrun the
command trains in place. Configuration errors print one message and exit with status 2
before anything is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from titan_train.__about__ import __version__
from titan_train.config_loader import ConfigError

__all__ = ["main"]

COMMANDS = ("train", "config", "list-models")
LAUNCH_FLAG = "--nproc-per-node"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``titan-train``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        print(f"titan-train {__version__}")
        return 0
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    try:
        if command == "list-models":
            return _list_models()
        nproc, argv = _pop_launch_flag(argv)
        if command == "config":
            return _print_config(argv)
        if nproc > 1 and "LOCAL_RANK" not in os.environ:
            return _launch(nproc, argv)
        return _train(argv)
    except _usage_errors() as error:
        print(f"titan-train: error: {error}", file=sys.stderr)
        return 2


def _usage_errors() -> tuple[type[Exception], ...]:
    """The errors that mean "the configuration cannot work": each package's own, raised
    before any work starts. Anything else is a bug and keeps its traceback."""
    from titan_ckpt import CheckpointConfigError
    from titan_dims import DistributedEnvError, ParallelDimsError
    from titan_models import ConfigError as ModelConfigError
    from titan_optim import OptimizerConfigError
    from titan_train.data import DataError
    from titan_train.metrics import MetricsError
    from titan_train.registry import UnknownModelError
    from titan_train.tokenizer import TokenizerError

    return (
        ConfigError,
        ParallelDimsError,
        DistributedEnvError,
        ModelConfigError,
        OptimizerConfigError,
        CheckpointConfigError,
        DataError,
        MetricsError,
        TokenizerError,
        UnknownModelError,
    )


def _train(argv: list[str]) -> int:
    from titan_train.config import parse_job_config
    from titan_train.trainer import run

    config = parse_job_config(argv)
    run(config)
    return 0


def _print_config(argv: list[str]) -> int:
    from titan_train.config import parse_job_config
    from titan_train.toml_writer import dumps

    # `--print` is accepted for clarity; printing the merged config is what `config` does.
    config = parse_job_config([a for a in argv if a != "--print"], prog="titan-train config")
    print(dumps(config.to_dict()), end="")
    return 0


def _list_models() -> int:
    from titan_train.registry import list_models, load_model_spec

    for name in list_models():
        spec = load_model_spec(name)
        print(f"{name}: {', '.join(spec.flavors)}")
    return 0


def _pop_launch_flag(argv: list[str]) -> tuple[int, list[str]]:
    rest, nproc = [], 1
    it = iter(argv)
    for arg in it:
        if arg == LAUNCH_FLAG or arg.startswith(f"{LAUNCH_FLAG}="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if value is None or not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{LAUNCH_FLAG} needs a whole number >= 1, got {value!r}.")
            nproc = int(value)
        else:
            rest.append(arg)
    return nproc, rest


def _launch(nproc: int, argv: list[str]) -> int:
    # Validate here, in one process, so a bad config fails once and not once per rank.
    from titan_train.config import parse_job_config
    from titan_train.trainer import check_checkpoint_folder

    check_checkpoint_folder(parse_job_config(argv))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "titan_train.cli",
        "train",
        *argv,
    ]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
