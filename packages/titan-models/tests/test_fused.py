"""titan_models.fused: the fused RMSNorm and SwiGLU give F.rms_norm's and silu(a) * b's
values and gradients (fp32 to ~1e-6 relative, bf16 to bf16 rounding), keep nn.RMSNorm's
parameters, fall back to the plain ops for DTensors and under torch.compile, and train a tiny
Llama 3 to the same losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn import functional

from titan_models.deepseek_v3 import DeepSeekV3, deepseek_v3_args
from titan_models.fused import FusedRMSNorm, rms_norm, swiglu
from titan_models.llama3 import Llama3, llama3_args
from titan_models.qwen3 import Qwen3, qwen3_args


def _grads(fn, *inputs: torch.Tensor, grad: torch.Tensor):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("shape", [(3, 17, 64), (40, 8), (5, 2, 3, 32)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_f_rms_norm_fp32(shape, with_weight):
    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape) * 3
    w = torch.randn(n) * 0.5 + 1
    grad = torch.randn(shape)
    if with_weight:
        ref, (rx, rw) = _grads(lambda x, w: functional.rms_norm(x, (n,), w, 1e-5), x, w, grad=grad)
        out, (fx, fw) = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w, grad=grad)
        assert _rel(fw, rw) < 1e-5
    else:
        ref, (rx,) = _grads(lambda x: functional.rms_norm(x, (n,), None, 1e-5), x, grad=grad)
        out, (fx,) = _grads(lambda x: rms_norm(x, None, 1e-5), x, grad=grad)
    assert _rel(out, ref) < 1e-6
    assert _rel(fx, rx) < 1e-5


def test_rms_norm_eps_none_is_the_dtype_epsilon():
    x = torch.full((2, 4), 1e-5, requires_grad=True)  # mean(x^2) far below fp32's epsilon
    expected = functional.rms_norm(x, (4,), None, None)
    assert torch.allclose(rms_norm(x, None, None), expected, rtol=1e-6)
    assert not torch.allclose(rms_norm(x, None, 1e-12), expected, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_bf16_matches_f_rms_norm(weight_dtype):
    """Low-precision inputs: the norm and the weight's product run in fp32 and the output
    has the input's dtype, whatever the weight's: F.rms_norm's values exactly."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, 32).bfloat16()
    w = (torch.randn(32) * 0.5 + 1).to(weight_dtype)
    grad = torch.randn(4, 9, 32).bfloat16()
    ref, (rx, rw) = _grads(lambda x, w: functional.rms_norm(x, (32,), w, 1e-6), x, w, grad=grad)
    out, (fx, fw) = _grads(lambda x, w: rms_norm(x, w, 1e-6), x, w, grad=grad)
    assert out.dtype == ref.dtype == x.dtype
    assert fx.dtype == x.dtype
    assert fw.dtype == weight_dtype
    assert torch.equal(out, ref)
    assert _rel(fx, rx) < 2e-2
    assert _rel(fw, rw) < 2e-2


def test_rms_norm_without_grad_takes_the_plain_op():
    x, w = torch.randn(3, 16), torch.randn(16)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-5), functional.rms_norm(x, (16,), w, 1e-5))


def test_swiglu_matches_silu_times_b():
    torch.manual_seed(0)
    a, b, grad = torch.randn(6, 5, 48) * 4, torch.randn(6, 5, 48), torch.randn(6, 5, 48)
    ref, (ra, rb) = _grads(lambda a, b: functional.silu(a) * b, a, b, grad=grad)
    out, (fa, fb) = _grads(swiglu, a, b, grad=grad)
    assert torch.equal(out, ref)
    assert _rel(fa, ra) < 1e-6
    assert _rel(fb, rb) < 1e-6


def test_swiglu_saves_one_full_size_tensor_less():
    """Saved for backward: a and b only, where silu(a) * b keeps silu(a) as well."""

    def saved_numel(fn) -> int:
        a = torch.randn(64, 32, requires_grad=True)
        b = torch.randn(64, 32, requires_grad=True)
        sizes: list[int] = []
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in seen:  # the leaves a and b count once each
                seen.add(id(t))
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(a, b)
        return sum(sizes)

    assert saved_numel(swiglu) == 2 * 64 * 32
    assert saved_numel(lambda a, b: functional.silu(a) * b) == 3 * 64 * 32


def test_fused_rms_norm_keeps_nn_rms_norm_parameters():
    plain, fused = nn.RMSNorm(16, eps=1e-5), FusedRMSNorm(16, eps=1e-5)
    assert isinstance(fused, nn.RMSNorm)
    assert list(fused.state_dict()) == list(plain.state_dict()) == ["weight"]
    y = fused(torch.randn(3, 16, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"  # the fused path, not F.rms_norm
    two_dims = FusedRMSNorm((4, 16))
    x = torch.randn(2, 4, 16, requires_grad=True)
    assert torch.allclose(two_dims(x), functional.rms_norm(x, (4, 16), two_dims.weight))


def test_under_torch_compile_the_plain_ops_are_traced():
    torch.manual_seed(0)
    norm = FusedRMSNorm(32, eps=1e-5)
    x = torch.randn(4, 32, requires_grad=True)
    compiled = torch.compile(lambda x: swiglu(norm(x), x), backend="eager", fullgraph=True)
    assert torch.allclose(compiled(x), functional.silu(norm(x)) * x, rtol=1e-6, atol=1e-6)


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_dtensor_inputs_take_the_plain_ops(mesh):
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(2, 8, 16), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(torch.randn(16), mesh, [Replicate()]).requires_grad_()
    out = rms_norm(x, w, 1e-5)
    assert isinstance(out, DTensor)
    assert torch.allclose(
        out.full_tensor(), functional.rms_norm(x.full_tensor(), (16,), w.full_tensor(), 1e-5)
    )
    out.sum().backward()
    assert isinstance(w.grad, DTensor)
    gated = swiglu(x, x)
    assert isinstance(gated, DTensor)
    assert torch.equal(gated.full_tensor(), functional.silu(x.full_tensor()) * x.full_tensor())


@pytest.mark.parametrize(
    ("build", "norms"),
    [
        (lambda: Llama3(llama3_args("debugmodel")), 2 * 6 + 1),
        (lambda: Qwen3(qwen3_args("debugmodel")), None),
        (lambda: DeepSeekV3(deepseek_v3_args("debugmodel")), None),
    ],
)
def test_every_family_norms_with_fused_rms_norm(build, norms):
    """The models' norms are FusedRMSNorm by default (block, QK and latent norms alike)."""
    with torch.device("meta"):
        model = build()
    found = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert found
    assert all(type(m) is FusedRMSNorm for m in found)
    if norms is not None:
        assert len(found) == norms


def test_tiny_llama_trains_to_the_same_losses(tiny):
    """Three AdamW steps of the tiny Llama 3 with its (fused) norms and with nn.RMSNorm's:
    the losses equal to 1e-5 relative."""
    inputs, labels = tiny.batches()

    def losses(fused: bool) -> list[float]:
        model = Llama3(tiny.tiny_args())
        model.load_state_dict(tiny.reference_state_dict())
        for module in model.modules():
            if isinstance(module, nn.RMSNorm):
                module.__class__ = FusedRMSNorm if fused else nn.RMSNorm
        optimizer = torch.optim.AdamW(model.parameters(), lr=tiny.LR, foreach=True)
        out = []
        for step in range(tiny.STEPS):
            loss = tiny.cross_entropy(model(inputs[step]), labels[step])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    plain, fused = losses(False), losses(True)
    assert fused == pytest.approx(plain, rel=1e-5)
    assert fused[-1] < fused[0]
