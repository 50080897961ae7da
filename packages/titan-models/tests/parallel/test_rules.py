"""The layout rules every family shares (titan_models.parallel.rules): each family's spec
``check_fn`` (what titan-train's preflight calls) refuses every rule's breach with the rule's
message, and accepts a layout that uses every feature. No process group: ``ParallelDims``
builds no mesh until asked."""

from __future__ import annotations

import math

import pytest

from titan_dims import ParallelDims
from titan_models import ModelConfigError, ParallelizeConfig, PipelineConfig
from titan_models.deepseek_v3 import DEEPSEEK_V3, DeepSeekV3Args
from titan_models.llama3 import LLAMA3, Llama3Args
from titan_models.qwen3 import QWEN3, Qwen3Args

_QWEN3 = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96)
_DEEPSEEK_V3 = dict(
    dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_heads=4, n_routed_experts=4,
    n_activated_experts=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
)  # fmt: skip
_MOE = {"moe_enabled": True, "num_experts": 4, "top_k": 2, "moe_inter_dim": 32}
_COMMON = {"vocab_size": 256, "max_seq_len": 32}
# Each family: its spec, a dense model and one with 4 experts (None: it has none); 4 query
# heads and at most 3 blocks in each.
FAMILIES = {
    "llama3": (LLAMA3, Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, **_COMMON), None),
    "qwen3": (QWEN3, Qwen3Args(**_QWEN3, **_COMMON), Qwen3Args(**_QWEN3, **_MOE, **_COMMON)),
    "deepseek_v3": (
        DEEPSEEK_V3,
        DeepSeekV3Args(**_DEEPSEEK_V3, n_dense_layers=2, **_COMMON),
        DeepSeekV3Args(**_DEEPSEEK_V3, n_dense_layers=1, **_COMMON),
    ),
}
# Each rule: the degrees, ParallelizeConfig fields, check_fn keywords, and the message.
RULES = {
    "whole heads per tp rank": ({"tp": 8}, {}, {}, "tp=8 must divide n_heads=4: each TP rank"),
    "seq_len splits over tp and cp": (
        {"tp": 2, "cp": 2}, {}, {"seq_len": 36}, r"seq_len=36 must be divisible by 8",
    ),
    "torch's cp needs its kernels": (
        {"cp": 2}, {"cp_attention": "torch"}, {}, "cp_attention='torch' cannot run on device",
    ),
    "the ring does not compile": (
        {"cp": 2}, {"cp_attention": "titan_ring", "compile": True}, {}, "P2P compilation disabled",
    ),
    "ep needs experts": ({"dp_shard": 2, "ep": 2}, {}, {}, r"^ep=2: .*; set ep=1\.$"),
    "ep shares the experts equally": (
        {"dp_shard": 8, "ep": 8}, {}, {}, "expert_parallel_degree=8 is not allowed with num_",
    ),
    "cpu_offload needs FSDP": ({"tp": 2}, {"cpu_offload": True}, {}, "but FSDP is off here"),
    "no DDP with tp": ({"dp_replicate": 2, "tp": 2}, {}, {}, "use HSDP instead: dp_shard > 1"),
    "a pipeline needs its settings": (
        {"pp": 2}, {}, {"local_batch_size": None}, "needs pipeline_config and local_batch_size",
    ),
    "whole microbatches": (
        {"pp": 2}, {},
        {"pipeline_config": PipelineConfig(microbatch_size=2), "local_batch_size": 3},
        "local_batch_size=3 is not a multiple",
    ),
    "the stage split": (
        {"pp": 2}, {}, {"pipeline_config": PipelineConfig(layers_per_stage=5)},
        "layers_per_stage=5 does not divide",
    ),
}  # fmt: skip
# Rules that need a model with experts.
WITH_EXPERTS = {"ep shares the experts equally"}


def _check(family: str, degrees: dict, config: dict, keywords: dict, *, experts: bool) -> None:
    spec, dense, moe = FAMILIES[family]
    dims = ParallelDims(
        world_size=math.prod(n for name, n in degrees.items() if name != "ep"),
        device_type="cpu",
        **degrees,
    )
    keywords = {"seq_len": 32, "pipeline_config": PipelineConfig(), "local_batch_size": 4} | (
        keywords
    )
    spec.check_fn(moe if experts else dense, dims, ParallelizeConfig(**config), **keywords)


@pytest.mark.parametrize(
    ("family", "rule"),
    [
        (family, rule)
        for family, (_, _, moe) in FAMILIES.items()
        for rule in RULES
        if moe is not None or rule not in WITH_EXPERTS
    ],
)
def test_every_family_refuses_every_shared_rule(family, rule):
    degrees, config, keywords, match = RULES[rule]
    with pytest.raises(ModelConfigError, match=match):
        _check(family, degrees, config, keywords, experts=rule in WITH_EXPERTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_accepts_a_layout_within_the_rules(family):
    """The fixes the messages name pass: HSDP x tp x cp (titan's attention, compiled) with
    cpu offload; a pipeline, with expert parallel where the family has experts."""
    hsdp_tp_cp = {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "cp": 2}
    config = {"cp_attention": "titan", "compile": True, "cpu_offload": True}
    _check(family, hsdp_tp_cp, config, {}, experts=False)
    experts = FAMILIES[family][2] is not None
    _check(family, {"pp": 2, "dp_shard": 2, "ep": 2 if experts else 1}, {}, {}, experts=experts)


def test_document_masking_is_refused_with_context_parallel_only() -> None:
    from titan_models.parallel import check_document_masking

    with pytest.raises(ModelConfigError, match="context parallel \\(cp=2\\)"):
        check_document_masking(ParallelDims(world_size=4, cp=2, dp_shard=2, device_type="cpu"))
    for degrees in ({"dp_shard": 2, "tp": 2}, {"pp": 2, "dp_shard": 2}, {"ep": 2, "dp_shard": 4}):
        check_document_masking(ParallelDims(world_size=4, device_type="cpu", **degrees))


def test_every_family_this_package_registers_is_checked_here() -> None:
    """A family added to the ``titan.models`` entry points without a row in ``FAMILIES`` would
    escape the rules above."""
    from importlib.metadata import entry_points

    ours = {e.name for e in entry_points(group="titan.models") if e.value.startswith("titan_m")}
    assert ours == set(FAMILIES)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_tensor_parallel_refuses_experts_it_cannot_split_whole(family):
    """Without expert parallel tp splits every routed expert's hidden dimension (and always
    the shared expert's): an odd width is refused before any work, naming the fix; tp=1,
    or expert parallel holding the routed experts (Qwen3 has no shared expert), passes."""
    spec, _, moe = FAMILIES[family]
    odd = {"moe_inter_dim": 33} | ({"n_shared_experts": 1} if family == "deepseek_v3" else {})
    odd = moe.__class__(**{**vars(moe), **odd})
    config, keywords = ParallelizeConfig(), {"seq_len": 32}
    tp2 = ParallelDims(world_size=2, tp=2, device_type="cpu")
    with pytest.raises(
        ModelConfigError,
        match=r"tp=2 must divide the routed experts' hidden size \(moe_inter_dim\)=33: each",
    ):
        spec.check_fn(odd, tp2, config, **keywords)
    spec.check_fn(moe, tp2, config, **keywords)
    spec.check_fn(odd, ParallelDims(world_size=1, device_type="cpu"), config, **keywords)
    ep_tp = ParallelDims(world_size=4, dp_shard=2, ep=2, tp=2, device_type="cpu")
    if family == "qwen3":
        spec.check_fn(odd, ep_tp, config, **keywords)
    else:
        with pytest.raises(
            ModelConfigError, match=r"shared expert's hidden size \(moe_inter_dim x 1\)=33"
        ):
            spec.check_fn(odd, ep_tp, config, **keywords)
