"""``FTOptimizersContainer`` with a real torchft ``Manager`` (one replica, local lighthouse).

The tests needing torchft are skipped when the ``torchft`` extra is not installed.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

from titan_optim import (
    FTOptimizersContainer,
    OptimizerConfig,
    OptimizersContainer,
    build_optimizers,
)

# torchft 0.2.0 logs through the deprecated Logger.warn; that is its business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")


def test_without_torchft_the_wrapper_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install titan-optim\[torchft\]"):
        FTOptimizersContainer(build_optimizers(nn.Linear(2, 2)), manager=object())


@pytest.fixture
def torchft():
    return pytest.importorskip("torchft")


@pytest.fixture
def manager(torchft):
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mgr = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id="titan-optim-test",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        use_async_quorum=False,
        timeout=timedelta(seconds=10),
    )
    yield mgr
    mgr.shutdown()
    lighthouse.shutdown()


def test_commits_steps_and_serves_cached_state_without_stepping(manager):
    torch.manual_seed(0)
    model, plain_model = nn.Linear(3, 2), nn.Linear(3, 2)
    plain_model.load_state_dict(model.state_dict())
    optimizers = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    plain = build_optimizers(plain_model, OptimizerConfig(lr=0.1))
    for _step in range(2):
        x = torch.randn(4, 3)
        for m, opt in ((model, optimizers), (plain_model, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    assert manager.current_step() == 2
    assert torch.equal(model.weight, plain_model.weight)  # same numbers as without torchft

    # Mid-step (gradients alive, nothing stepped yet) a peer reads our state for recovery.
    optimizers.zero_grad()
    model(torch.randn(4, 3)).square().mean().backward()
    before = model.weight.detach().clone()
    peer_view = manager._manager_state_dict()["user"]["optimizer"]
    assert peer_view is optimizers.state_dict()  # the cache, not a recomputation
    assert peer_view["state.weight.step"].item() == 2.0  # as of the last committed step
    assert torch.equal(model.weight, before)


def test_the_state_is_built_when_asked_not_at_every_step(manager):
    """F23: the flat optimizer state dict (a walk over every parameter's state) is built on
    demand, once per committed step, not after each step whether anyone reads it or not."""

    class Counting(OptimizersContainer):
        builds = 0

        def state_dict(self):
            Counting.builds += 1
            return super().state_dict()

    model = nn.Linear(3, 2)
    inner = Counting([model], [[torch.optim.AdamW(model.parameters(), lr=0.1)]])
    optimizers = FTOptimizersContainer(inner, manager)
    for _step in range(3):
        optimizers.zero_grad()
        model(torch.randn(4, 3)).square().mean().backward()
        optimizers.step()
    assert Counting.builds == 0
    first = optimizers.state_dict()
    assert optimizers.state_dict() is first
    assert Counting.builds == 1
    assert first["state.weight.step"].item() == 3.0
    optimizers.zero_grad()
    model(torch.randn(4, 3)).square().mean().backward()
    optimizers.step()
    assert optimizers.state_dict()["state.weight.step"].item() == 4.0
    assert Counting.builds == 2


def test_uncommitted_step_is_skipped(manager):
    model = nn.Linear(3, 2)
    optimizers = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    optimizers.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    manager.report_error(RuntimeError("a peer failed mid-allreduce"))
    before = model.weight.detach().clone()
    optimizers.step()
    assert torch.equal(model.weight, before)


def _counted_step(optimizers, model, counts, *, fail=False, nonfinite=False):
    """One step with ``counts`` (a registered buffer) set to local values [5, 7]; returns
    what the after-step hook saw (None if it did not run)."""
    seen = []
    handle = optimizers.optimizers.register_step_post_hook(lambda _c: seen.append(counts.tolist()))
    optimizers.zero_grad()
    counts.copy_(torch.tensor([5, 7]))
    model(torch.randn(4, 3)).sum().backward()
    if nonfinite:
        model.weight.grad[0, 0] = float("nan")
    if fail:
        manager = optimizers.manager
        manager.report_error(RuntimeError("a peer failed mid-allreduce"))
    optimizers.clip_grad_norm_(1.0)
    optimizers.step()
    handle.remove()
    return seen[0] if seen else None


def test_summed_buffers_reach_the_after_step_hook_of_committed_steps_only(manager):
    """One replica group (the sum is the local value; two groups: the test below): a
    committed step's hook reads the buffer, a skipped or uncommitted step runs no hook and
    leaves the local values."""
    model = nn.Linear(3, 2)
    optimizers = FTOptimizersContainer(build_optimizers(model), manager)
    counts = torch.zeros(2, dtype=torch.int64)
    optimizers.sum_over_replica_groups(lambda: [counts])
    assert _counted_step(optimizers, model, counts) == [5, 7]
    assert _counted_step(optimizers, model, counts, nonfinite=True) is None
    assert counts.tolist() == [5, 7]
    assert _counted_step(optimizers, model, counts, fail=True) is None
    assert counts.tolist() == [5, 7]


def _count_allreduces(manager, monkeypatch):
    calls = []
    real = manager.allreduce

    def allreduce(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(manager, "allreduce", allreduce)
    return calls


@pytest.mark.parametrize("clip", [True, False])
def test_gradients_are_averaged_once_per_step_before_clipping(manager, monkeypatch, clip):
    """The replica-group average runs inside the container (clip first, else step), once."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ft = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    calls = _count_allreduces(manager, monkeypatch)
    ft.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    if clip:
        ft.clip_grad_norm_(1.0)
        assert len(calls) == 1  # weight and bias in one bucket, before the norm was taken
    ft.step()
    assert calls == [torch.Size([model.weight.numel() + model.bias.numel()])]


def test_gradient_buckets_respect_cap_device_and_dtype():
    from titan_optim.ft import gradient_buckets

    f32 = [torch.zeros(n) for n in (4, 4, 10, 1)]  # 16, 16, 40, 4 bytes
    bf16 = torch.zeros(8, dtype=torch.bfloat16)  # 16 bytes
    tensors = [f32[0], bf16, f32[1], f32[2], f32[3]]

    def ids(buckets):
        return [[next(i for i, t in enumerate(tensors) if t is x) for x in b] for b in buckets]

    # 32 bytes: the two small fp32 together, bf16 apart; the 40-byte one alone.
    assert ids(gradient_buckets(tensors, 32)) == [[0, 2], [1], [3], [4]]
    assert ids(gradient_buckets(tensors, 2**20)) == [[0, 2, 3, 4], [1]]
    assert ids(gradient_buckets(tensors, 0)) == [[0], [1], [2], [3], [4]]


def test_bucket_cap_must_be_a_size():
    with pytest.raises(ValueError, match=r"bucket_cap_mb=-1 is not allowed; use a size in MiB"):
        FTOptimizersContainer(build_optimizers(nn.Linear(2, 2)), manager=object(), bucket_cap_mb=-1)


def test_two_replica_groups_average_in_buckets_with_fewer_allreduces(torchft, tmp_path):
    """Two replica groups (processes) under a real lighthouse, gloo: bucketed averages are
    bit for bit the per-gradient ones and the mean of both groups' gradients, in one
    all-reduce per (dtype) bucket instead of one per parameter; a buffer registered with
    ``sum_over_replica_groups`` is the exact int64 sum of both groups' (local again after a
    skipped step)."""
    import json
    import os
    import subprocess

    from torchft._torchft import LighthouseServer

    worker = os.path.join(os.path.dirname(__file__), "workers", "ft_buckets.py")
    sys.path.insert(0, os.path.dirname(worker))
    try:
        import ft_buckets
    finally:
        sys.path.pop(0)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, worker, lighthouse.address(), str(r), str(tmp_path / f"{r}.json")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            for r in (0, 1)
        ]
        for proc in procs:
            output, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, output[-3000:]
    finally:
        lighthouse.shutdown()
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    model = ft_buckets.build_model()
    for step in ("1", "2", "3"):
        expected = [
            ((g0.float() + g1.float()) / 2).to(p.dtype).float()
            for p, g0, g1 in zip(
                model.parameters(),
                ft_buckets.replica_gradients(0, int(step), model),
                ft_buckets.replica_gradients(1, int(step), model),
                strict=True,
            )
        ]
        for result in results:
            assert result[step]["participants"] == 2
            assert result[step]["contiguous"] == [False, True, False, True]  # left in place
            for got, want in zip(result[step]["grads"], expected, strict=True):
                torch.testing.assert_close(torch.tensor(got), want, atol=0, rtol=0)
        # The registered int64 buffer: summed over both groups, exactly.
        summed = ft_buckets.replica_counts(0, int(step)) + ft_buckets.replica_counts(1, int(step))
        for result in results:
            assert result[step]["counts"] == summed.tolist()
    for replica, result in enumerate(results):  # the skipped step: local values again
        assert result["skipped"] == {
            "counts": ft_buckets.replica_counts(replica, 4).tolist(),
            "skips": 1,
        }
    # Gradients: fp32 4x6 and 4, bf16 3x4 and 3. Per gradient: 4 calls; 25 MiB buckets: one
    # per dtype; 64-byte buckets: fp32 weight (96 bytes) alone, then bias; bf16 in one. Then
    # the summed buffer (3 elements).
    assert results[0]["1"]["allreduce_numels"] == [24, 4, 12, 3, 3]
    assert results[0]["2"]["allreduce_numels"] == [28, 15, 3]
    assert results[0]["3"]["allreduce_numels"] == [24, 4, 15, 3]
