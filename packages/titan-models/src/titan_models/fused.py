"""Eager fused RMSNorm and SwiGLU: the numbers of ``F.rms_norm`` and ``silu(a) * b`` with
fewer passes over memory and fewer temporaries, for runs without ``torch.compile`` (whose
inductor fuses the plain ops itself, for seconds of compile per process).

``rms_norm``: one reduction forward, the input and per-row ``rsqrt`` saved, the analytic
gradient backward; ~21 ms against ~41 ms for ``F.rms_norm`` forward + backward at the Llama
3 debug model's shape on one thread (``tools/bench/fused_ops.py``). Every family's norms are
``FusedRMSNorm``. ``swiglu`` saves ``a`` and ``b`` only and recomputes ``silu(a)``: one
activation less per block, but ~15% slower on the CPU, so the models do not use it.

Both take the plain ops for DTensor inputs (TP hands norms sequence-sharded DTensors), under
``torch.compile``, and when no gradient is tracked."""

from __future__ import annotations

import torch
import torch.nn.functional as functional
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["FusedRMSNorm", "rms_norm", "swiglu"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _fusable(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused path applies: no DTensor among ``tensors`` and not being traced by
    ``torch.compile``."""
    if torch.compiler.is_compiling():
        return False
    return not any(isinstance(t, DTensor) for t in tensors)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision its reductions run in: fp32 for fp16 and bf16 (as
    ``F.rms_norm`` upcasts), itself otherwise."""
    return t.float() if t.dtype in _LOW_PRECISION else t


class _RMSNorm(torch.autograd.Function):
    """``F.rms_norm`` over the last dimension with an optional weight; see ``rms_norm``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = _opmath(x)
        n = x.shape[-1]
        # rsqrt(mean(x^2) + eps) from one norm reduction: no full-size x^2.
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        r = r.square_().div_(n).add_(eps).rsqrt_()
        y = torch.mul(xf, r)
        if weight is not None:
            y.mul_(weight)  # in the reduction's precision, as F.rms_norm
        y = y.to(x.dtype)  # torch's output dtype: the input's, whatever the weight's
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        n = x.shape[-1]
        x2 = _opmath(x).reshape(-1, n)
        g2 = _opmath(grad).reshape(-1, n)
        r2 = r.reshape(-1, 1)
        w = None if weight is None else _opmath(weight)
        # With x_hat = x * r and gw = g * w:
        #   dx = r * gw - x * r^3 * sum(gw * x) / n,   dw = sum over rows of g * x * r.
        gx = g2 * x2
        s = gx @ w.unsqueeze(-1) if w is not None else gx.sum(-1, keepdim=True)
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = gx.mul_(r2).sum(0).to(weight.dtype)
        c = s.mul_(r2.pow(3)).div_(n)
        dx = g2 * w if w is not None else g2.clone()
        dx.mul_(r2).addcmul_(x2, c, value=-1)
        return dx.reshape(x.shape).to(x.dtype), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)`` with the fused eager forward and
    backward (see the module's docstring); ``eps=None`` is the input dtype's machine epsilon,
    as in torch. DTensor inputs and code being compiled take ``F.rms_norm`` itself."""
    n = x.shape[-1]
    if not _fusable(x, weight) or not (
        x.requires_grad or (weight is not None and weight.requires_grad)
    ):
        return functional.rms_norm(x, (n,), weight, eps)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    """``silu(a) * b`` saving ``a`` and ``b`` only; see ``swiglu``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        silu = functional.silu(a)
        return silu.mul_(b) if torch.result_type(silu, b) == silu.dtype else silu * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            # silu'(a) = sig * (1 + a * (1 - sig)), applied to g * b by one fused kernel.
            da = torch.ops.aten.silu_backward(grad * b, a)
        if ctx.needs_input_grad[1]:
            db = functional.silu(a).mul_(grad).to(b.dtype)
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` keeping one full-size activation less for the backward (it recomputes
    ``silu(a)``). Same values and gradients; on the CPU slower than the plain expression
    (see the module's docstring). DTensor inputs and code being compiled take the plain
    expression."""
    if not _fusable(a, b) or not (a.requires_grad or b.requires_grad):
        return functional.silu(a) * b
    return _SwiGLU.apply(a, b)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, state-dict keys and tensor-parallel plans) whose
    forward takes ``rms_norm``'s fused path over the last dimension. A norm over more than
    one trailing dimension takes ``nn.RMSNorm``'s own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)
