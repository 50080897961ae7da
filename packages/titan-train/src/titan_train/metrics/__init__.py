"""Metrics: a console line, TensorBoard scalars, a JSONL file and optional Weights & Biases
every ``log_freq`` steps, with throughput, TFLOPs and MFU against a device's peak FLOP/s
(a table for GPUs, a short matmul probe on CPU). Throughput is per device: a step's tokens
over all ranks (``tokens_of_step``) divided by its seconds and its devices."""

from titan_train.metrics.config import MetricsConfig, MetricsError
from titan_train.metrics.flops import (
    GPU_PEAK_BF16_FLOPS,
    gpu_peak_flops,
    measure_cpu_matmul_flops,
    peak_flops,
)
from titan_train.metrics.logger import MetricsLogger
from titan_train.metrics.memory import device_memory
from titan_train.metrics.throughput import StepTokens, tokens_of_step

__all__ = [
    "GPU_PEAK_BF16_FLOPS",
    "MetricsConfig",
    "MetricsError",
    "MetricsLogger",
    "StepTokens",
    "device_memory",
    "gpu_peak_flops",
    "measure_cpu_matmul_flops",
    "peak_flops",
    "tokens_of_step",
]
