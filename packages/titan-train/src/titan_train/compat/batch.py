"""torchtitan 2026's token-counted batches (``training.num_tokens_per_microbatch_per_dp_rank``,
``training.num_tokens_per_train_step``, ``parallelism.num_pp_microbatches``) in titan's
sequences of ``training.seq_len``, once the config is loaded (``resolve_batch``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from titan_train.errors import ConfigError

__all__ = ["resolve_batch"]

logger = logging.getLogger("titan_train")

_TITAN_BATCH = {
    "training.num_tokens_per_microbatch_per_dp_rank": "training.local_batch_size",
    "training.num_tokens_per_train_step": "training.global_batch_size",
    "parallelism.num_pp_microbatches": "pipeline.microbatch_size",
}


def resolve_batch(
    config: Any, batch: Mapping[str, Any], *, cli: Sequence[str], follow_validation: bool
) -> Any:
    """``config`` with ``Translation.batch``'s token counts over ``seq_len`` (a titan key in
    ``cli`` wins); ``follow_validation``: validation takes training's, as torchtitan's."""
    given = {_flag_key(arg) for arg in cli if arg.startswith("--")}
    training, pipeline = config.training, config.pipeline
    seq = training.seq_len
    pp = config.parallelism.pipeline_parallel_degree > 1
    n_mb = _count(batch, "parallelism.num_pp_microbatches", 1, minimum=1)
    changed: dict[str, Any] = {}
    tokens = batch.get("training.num_tokens_per_microbatch_per_dp_rank")
    if tokens is not None and "training.local_batch_size" not in given:
        per_microbatch = _sequences("training.num_tokens_per_microbatch_per_dp_rank", tokens, seq)
        changed["local_batch_size"] = per_microbatch * (n_mb if pp else 1)
    per_step = batch.get("training.num_tokens_per_train_step")
    if per_step not in (None, -1) and "training.global_batch_size" not in given:
        changed["global_batch_size"] = _sequences(
            "training.num_tokens_per_train_step", per_step, seq
        )
    local = changed.get("local_batch_size", training.local_batch_size)
    microbatch = None
    if (
        pp
        and "parallelism.num_pp_microbatches" in batch
        and "pipeline.microbatch_size" not in given
    ):
        if local % n_mb:
            raise ConfigError(
                f"parallelism.num_pp_microbatches={n_mb} does not divide the local batch of "
                f"{local} sequences (training.local_batch_size); choose a divisor of it."
            )
        microbatch = local // n_mb
    if changed:
        config = dataclasses.replace(config, training=dataclasses.replace(training, **changed))
    if microbatch is not None:
        config = dataclasses.replace(
            config, pipeline=dataclasses.replace(pipeline, microbatch_size=microbatch)
        )
    if follow_validation and not given & {"validation.seq_len", "validation.local_batch_size"}:
        validation = dataclasses.replace(
            config.validation,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )
        config = dataclasses.replace(config, validation=validation)
    if changed or microbatch is not None:
        logger.info(
            "torchtitan's token-counted batch at training.seq_len %d: %s",
            seq,
            ", ".join(
                f"{k} {v}"
                for k, v in [
                    *((f"training.{k}", v) for k, v in changed.items()),
                    *((("pipeline.microbatch_size", microbatch),) if microbatch else ()),
                ]
            ),
        )
    return config


def _count(batch: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = batch.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value!r} is not allowed; give a whole number >= {minimum}.")
    return value


def _sequences(key: str, tokens: Any, seq_len: int) -> int:
    """``tokens`` as whole sequences of ``seq_len``; raises ``ConfigError`` otherwise."""
    _count({key: tokens}, key, 0, minimum=1)
    if tokens % seq_len:
        raise ConfigError(
            f"{key}={tokens} is not a whole number of sequences of training.seq_len={seq_len} "
            f"(titan batches whole sequences); give a multiple of {seq_len}, e.g. "
            f"{max(1, tokens // seq_len) * seq_len}, or set {_TITAN_BATCH[key]} instead."
        )
    return tokens // seq_len


def _flag_key(arg: str) -> str:
    """``--training.local-batch-size=4`` -> ``training.local_batch_size``."""
    return arg[2:].partition("=")[0].replace("-", "_")
