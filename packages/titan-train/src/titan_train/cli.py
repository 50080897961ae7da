"""The ``titan-train`` command.

    titan-train                                   # train the Llama 3 debug model, embedded data
    titan-train train --job.config_file run.toml --training.steps 100
    titan-train --nproc-per-node 2 --parallelism.data_parallel_shard_degree 2
    titan-train config --print [--job.config_file run.toml ...]   # the merged config as TOML
    titan-train --module llama3 --config llama3_debugmodel     # torchtitan 2026's configurations
    titan-train config import --torchtitan-module llama3 --config llama3_debugmodel -o run.toml
    titan-train list-models
    titan-train generate --checkpoint.path outputs/checkpoint/step-30 --prompt "Once upon"
    titan-train estimate --world-size 64 --parallelism.tensor_parallel_degree 8 [--json]

Commands (``titan-train COMMAND --help`` documents each; no command means ``train``):
  train          train a model (the default)
  config         print the merged configuration as TOML (``--print``); ``config import``
                 writes a torchtitan 2026 configuration as a titan TOML file
  list-models    list the model families and their flavors
  generate       sample text from a checkpoint, a Hugging Face folder or a random model
  estimate       one rank's memory for a run of any layout and world size

The options of ``train`` (below) take torchtitan's spellings too: ``--training.compile``,
``--checkpoint.no-enable-checkpoint``, ``--activation_checkpoint.mode full``, lists as
``a,b``; torchtitan TOML files load unchanged (titan-train's README has the table).
torchtitan 2026's ``--module M --config F`` name the llama3, deepseek_v3 and qwen3
configurations of its registries (other flags still override them). ``--model.args.KEY
VALUE`` (``[model.args]`` in a file) sets any argument of the model family's args
(``dim``, ``n_layers``, ``n_heads``, ``vocab_size``...) over its flavor's.
``--nproc-per-node N`` (with N > 1, outside torchrun) starts N processes through
``torch.distributed.run`` on this machine; under torchrun or SLURM-launched torchrun the
command trains in place. Launcher flags (torch's elastic agent and c10d rendezvous do the
work; titan_train.launch):
  --nproc-per-node N       processes on this node (default 1)
  --max-restarts N         restart every process up to N times after one dies; each restart
                           resumes from the newest committed checkpoint (default 0)
  --nnodes N               nodes, each running this same command (default 1)
  --node-rank R            this node, 0..N-1; node 0 hosts the rendezvous
  --rdzv-endpoint HOST:PORT  where the nodes meet (node 0's address, a free port); needed
                           with --nnodes > 1
  --rdzv-id NAME           the job's name at the rendezvous, the same on every node
  --rdzv-timeout SECONDS   how long a node waits for the endpoint to answer (default 60)

Configuration errors (launcher flags and an unreachable rendezvous included) print one
message and exit with status 2 before anything is written; a run that cannot go on (another
run holds its checkpoint folder, refused before any work; the disk full, training diverged
past training.skip_nonfinite_steps) prints one message and exits with status 1. On SIGTERM (a
scheduler's stop) the ranks finish the step, save it (checkpoint.save_on_sigterm) and exit
with status 143; a second SIGTERM exits at once.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from titan_train.__about__ import __version__
from titan_train.trainer import host_memory

if TYPE_CHECKING:
    from titan_train.launch import LaunchOptions

# Nothing that imports torch is imported before main() runs: a CPU run starts itself again
# at once (host_memory.restart_early), so that start costs milliseconds, not the imports.

__all__ = ["main"]

COMMANDS = ("train", "config", "list-models", "generate", "estimate")

_CONFIG_HELP = """titan-train config: print the merged configuration of a run as TOML
(defaults, then the TOML file, then the command line), in the form --job.config_file reads.

    titan-train config --print
    titan-train config --print --job.config_file run.toml --training.steps 100 > merged.toml

  --print        print the configuration (what config does; accepted for clarity)
Every other option is train's (below), checked as a run checks it (exit status 2).

    titan-train config import --torchtitan-module M --config F [--output FILE] [--force]

writes torchtitan 2026's configuration F of module M (llama3, deepseek_v3, qwen3) as a
titan TOML file (stdout without --output; an existing FILE only with --force), listing what
is not carried; train's options after it are written too.
"""

_LIST_MODELS_HELP = """titan-train list-models: the model families titan-train can train
(built in, or installed through an entry point) and each one's flavors.

    titan-train list-models
    titan-train --model.name qwen3 --model.flavor debugmodel   # train one of them
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``titan-train``; returns the exit status."""
    # Only the command's own process is started again in place (host_memory): in a program
    # that calls main() itself, a restart would run that whole program a second time.
    owns_process = argv is None and _started_as_command()
    argv = list(sys.argv[1:] if argv is None else argv)
    if owns_process and (not argv or argv[0] == "train" or argv[0].startswith("-")):
        host_memory.restart_early()
    _setup_logging()
    return quiet_on_closed_pipe(lambda: _main(argv, owns_process))


def _started_as_command() -> bool:
    """Whether this process is the ``titan-train`` script or ``python -m titan_train.cli``."""
    script = sys.argv[0] if sys.argv else ""
    return os.path.basename(script) == "titan-train" or (
        os.path.realpath(script) == os.path.realpath(__file__)
    )


def _main(argv: list[str], owns_process: bool = False) -> int:
    if argv and argv[0] in ("--version", "-V"):
        print(f"titan-train {__version__}")
        return 0
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        return _help()
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(
            f"titan-train: error: unknown command {argv[0]!r}; the commands are "
            f"{', '.join(COMMANDS)} (titan-train COMMAND --help).",
            file=sys.stderr,
        )
        return 2
    from titan_train.launch import pop_launch_options
    from titan_train.trainer.preemption import PREEMPTED_EXIT, PreemptedError

    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    asks_help = bool({"-h", "--help"} & set(argv))
    try:
        if command == "list-models":
            if asks_help:
                print(_LIST_MODELS_HELP)
                return 0
            return _list_models()
        if command == "train" and asks_help:
            return _help()
        launch, argv = pop_launch_options(argv)
        if command == "config":
            return _print_config(argv)
        if command == "generate":
            return _generate(launch, argv)
        if command == "estimate":  # one process whatever the world size (estimate_cli)
            from titan_train.estimate.cli import run_estimate

            return run_estimate(argv)
        if launch.launches:
            return _launch(launch, argv)
        return _train(argv, owns_process)
    except _usage_errors() as error:
        print(f"titan-train: error: {error}", file=sys.stderr)
        return 2
    except PreemptedError:
        return PREEMPTED_EXIT  # the run logged why; the save, if any, is committed
    except _run_stops() as error:
        # Every rank raises the same agreed error: one copy is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"titan-train: error: {error}", file=sys.stderr)
        return 1


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run ``command``; when stdout's reader goes away (``titan-train ... | head``), exit 141
    (128 + SIGPIPE, as SIGPIPE would) without a traceback."""
    try:
        status = command()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush fails no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _setup_logging() -> None:
    """One log line per message on stderr, Python warnings included (a clamped LR schedule
    is a line of the log, not a warning with its source line); INFO on rank 0 only."""
    rank = int(os.environ.get("RANK", "0") or 0)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    warnings.showwarning = _log_warning


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    text = str(message) if category is UserWarning else f"{category.__name__}: {message}"
    logging.getLogger("titan_train").warning("%s", text)


def _help(text: str | None = None, prog: str = "titan-train") -> int:
    """``text`` (default: this module's docstring: the commands, examples and launcher flags),
    then every option of ``train``."""
    from titan_train.config import parse_job_config

    print((text or __doc__ or "").replace("``", ""))
    try:
        parse_job_config(["--help"], prog=prog)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0
    return 0


def _usage_errors() -> tuple[type[Exception], ...]:
    """The user's to fix, before any work (exit 2): each package's configuration error, an
    incomplete launcher environment, a checkpoint whose pickles ask for code. Anything else
    is a bug and keeps its traceback."""
    from titan_ckpt import CheckpointConfigError, UnsafeCheckpointError
    from titan_dims import DistributedEnvError, ParallelDimsError
    from titan_models import ModelConfigError
    from titan_optim import OptimizerConfigError
    from titan_train.errors import ConfigError

    return (
        ConfigError,
        ParallelDimsError,
        ModelConfigError,
        OptimizerConfigError,
        CheckpointConfigError,
        DistributedEnvError,
        UnsafeCheckpointError,
    )


def _run_stops() -> tuple[type[Exception], ...]:
    """Errors that stop a run with the whole story in the message (a held or lost folder, a
    full disk, divergence): no traceback."""
    from titan_ckpt import CheckpointLockError, CheckpointWriteError
    from titan_train.trainer.nonfinite import NonFiniteStepsError

    return (CheckpointLockError, CheckpointWriteError, NonFiniteStepsError)


def _train(argv: list[str], owns_process: bool = False) -> int:
    from titan_train.compat import check_supported
    from titan_train.config import parse_job_config
    from titan_train.launch import check_restartable
    from titan_train.trainer.loop import run

    if owns_process:
        host_memory.settle(lambda: _wants_host_memory(argv))
    config = parse_job_config(argv)
    check_supported(config.model.converters, config.parallelize.param_dtype)
    check_restartable()  # under torchrun --max-restarts: a restart must not hang
    if config.training.reuse_host_memory and _on_cpu():
        # A process-wide allocator setting: this command owns its process, a program that
        # calls titan_train.run() owns its own and keeps its allocator as it set it.
        host_memory.reuse_host_memory()
    run(config)
    return 0


def _on_cpu() -> bool:
    from titan_dims import detect_device_type

    return detect_device_type() == "cpu"


def _wants_host_memory(argv: list[str]) -> bool | None:
    """A CPU run with training.reuse_host_memory, read quietly (before a restart nothing may
    be written; the run's own reading reports the configuration's warnings and errors);
    ``None`` where the configuration does not read: no restart before that error."""
    from titan_train.config import parse_job_config

    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_job_config(argv).training.reuse_host_memory and _on_cpu()
    except Exception:  # reported, once, by the run's own reading
        return None
    finally:
        logging.disable(logging.NOTSET)


def _generate(launch: LaunchOptions, argv: list[str]) -> int:
    """``titan-train generate`` (``titan_train.generate.cli``): in this process, or, with
    ``--nproc-per-node N`` outside torchrun, checked here once and then run on N ranks."""
    from titan_train.generate.cli import parse_generate_options, prepare, run_generate

    options = parse_generate_options(argv)
    if launch.launches:
        prepare(options, launch.world_size)  # every check, once, before the ranks start
        launch.check_rendezvous()
        return _run_ranks(launch, ["generate", *argv])
    return run_generate(options)


def _print_config(argv: list[str]) -> int:
    from titan_train.config import parse_job_config
    from titan_train.config.toml_writer import dumps

    if argv and argv[0] == "import":
        from titan_train.compat.config_import import run_config_import

        return run_config_import(argv[1:])
    if {"-h", "--help"} & set(argv):
        return _help(_CONFIG_HELP, prog="titan-train config")
    # `--print` is accepted for clarity; printing the merged config is what `config` does.
    config = parse_job_config([a for a in argv if a != "--print"], prog="titan-train config")
    print(dumps(config.to_dict()), end="")
    return 0


def _list_models() -> int:
    from titan_train.config.registry import list_models, load_model_spec

    for name in list_models():
        spec = load_model_spec(name)
        print(f"{name}: {', '.join(spec.flavors)}")
    return 0


def _launch(launch: LaunchOptions, argv: list[str]) -> int:
    # Preflight for the ranks' world here, so a bad config fails once, not once per rank;
    # quietly: rank 0 logs the config's warnings once the ranks start.
    import torch

    from titan_dims import detect_device_type
    from titan_train.config import parse_job_config
    from titan_train.preflight import World, preflight
    from titan_train.trainer.memory_fit import check_launch_fits

    logging.disable(logging.WARNING)
    try:
        # What a rank imports before building: the floor memory_fit counts per rank.
        import titan_train.trainer.build  # noqa: F401

        config = parse_job_config(argv)
        device = torch.device(detect_device_type())
        world = World(
            rank=0,
            world_size=launch.world_size,
            device=device,
            local_world_size=launch.nproc_per_node,
            started=False,
        )
        preflight(config, world)
        check_launch_fits(
            config, world_size=launch.world_size, local_ranks=launch.nproc_per_node, device=device
        )
    finally:
        logging.disable(logging.NOTSET)
    if launch.max_restarts and not config.checkpoint.enable:
        logging.getLogger("titan_train").warning(
            "--max-restarts %d with checkpoint.enable=false: a restart trains from step 1 again",
            launch.max_restarts,
        )
    launch.check_rendezvous()  # after the config: a bad config needs no waiting to report
    wanted = device.type == "cpu" and config.training.reuse_host_memory
    return _run_ranks(launch, ["train", *argv], host_memory.launch_environment(wanted))


def _run_ranks(
    launch: LaunchOptions, argv: list[str], environ: dict[str, str] | None = None
) -> int:
    """Run ``titan-train ARGV`` on this node's ranks through ``torch.distributed.run``
    (torch's elastic agent: it starts, watches and restarts them), in ``environ`` (default:
    this process's)."""
    from titan_train.launch import run_agent

    command = [sys.executable, "-m", "torch.distributed.run", *launch.torchrun_args()]
    env = {**launch.torchrun_env(), **(os.environ if environ is None else environ)}
    return run_agent([*command, "-m", "titan_train.cli", *argv], env)  # the user's env wins


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        from titan_train.launch import exit_rank

        exit_rank(status)
    sys.exit(status)
