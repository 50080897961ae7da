"""``ParallelDims``: validated parallel degrees and the device mesh they imply.

The mesh layout and its process groups are the same as torchtitan's ``ParallelDims``
(July 2025), for every configuration and every rank, so a model parallelized against
torchtitan's groups sees the same groups here:

* Mesh dimensions, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``; with
  expert parallelism ``pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp``. A
  dimension of degree 1 is left out, except ``dp_shard_mod_ep``, which EP layouts keep even
  at 1 because FSDP-wrapping the MoE layers over it gives them mixed precision.
* Flattened sub-meshes: ``dp`` (data loading: replicate x shard), ``dp_shard_cp``
  (parameter sharding: shard x cp), ``dp_cp`` (loss reduction: replicate x shard x cp) and,
  with EP, ``ep`` (dp_shard_in_ep x cp). EP borrows its ranks from dp_shard x cp, so
  ``cp | ep | dp_shard * cp``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from titan_dims.errors import ParallelDimsError, check_int
from titan_dims.layout import MeshLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_dims.config import ParallelismConfig

__all__ = ["ParallelDims", "ParallelDimsError"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The parallel degrees of a run and, built on first use, its ``DeviceMesh``.

    Construction only validates (``dp_shard=-1`` becomes "every rank left over"); nothing
    touches ``torch.distributed`` until :attr:`world_mesh` or :meth:`get_mesh` is used, so
    the object is cheap in planning code and tests.

    >>> dims = ParallelDims(world_size=64, tp=8, pp=2)
    >>> dims.dp_shard, dims.fsdp_enabled, dims.seq_len_divisor
    (4, True, 16)
    >>> dims.layout.dim_names
    ('pp', 'dp_shard', 'tp')
    """

    world_size: int
    """Number of ranks; the degrees must multiply to it."""
    dp_replicate: int = 1
    """Model replicas (DDP, or HSDP's replicate dimension)."""
    dp_shard: int = -1
    """Ranks parameters are sharded over (FSDP); -1 takes every rank left over."""
    cp: int = 1
    """Context-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree, borrowed from dp_shard x cp."""
    device_type: str | None = None
    """Device type of the mesh; ``None`` detects it (an accelerator if present, else cpu)."""

    _meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        for name in _DEGREES:
            rest = (-1, "use the remaining ranks") if name == "dp_shard" else None
            check_int(name, getattr(self, name), minimum=1, sentinel=rest)
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelDimsError(
                    f"Cannot infer dp_shard: dp_replicate({self.dp_replicate}) * cp({self.cp}) "
                    f"* tp({self.tp}) * pp({self.pp}) = {others} does not divide "
                    f"world_size({self.world_size}). {self._suggestion()}"
                )
            # Frozen dataclass: resolve "the rest" once, here, before anyone reads it.
            object.__setattr__(self, "dp_shard", self.world_size // others)
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) "
                f"* tp({self.tp}) * pp({self.pp}) = {product}, but world_size is "
                f"{self.world_size}. {self._suggestion()}"
            )
        if self.ep > 1:
            if self.ep % self.cp:
                raise ParallelDimsError(
                    f"ep({self.ep}) must be a multiple of cp({self.cp}): expert parallelism "
                    f"borrows every context-parallel rank. {self._suggestion()}"
                )
            if (self.dp_shard * self.cp) % self.ep:
                raise ParallelDimsError(
                    f"ep({self.ep}) must divide dp_shard({self.dp_shard}) * cp({self.cp}) = "
                    f"{self.dp_shard * self.cp}: expert parallelism borrows its ranks from "
                    f"them. {self._suggestion()}"
                )

    @classmethod
    def from_config(
        cls, config: ParallelismConfig, world_size: int, *, device_type: str | None = None
    ) -> ParallelDims:
        """Build from a :class:`~titan_dims.ParallelismConfig` section."""
        return cls(
            world_size=world_size,
            dp_replicate=config.data_parallel_replicate_degree,
            dp_shard=config.data_parallel_shard_degree,
            cp=config.context_parallel_degree,
            tp=config.tensor_parallel_degree,
            pp=config.pipeline_parallel_degree,
            ep=config.expert_parallel_degree,
            device_type=device_type,
        )

    # ----------------------------------------------------------------- which parallelisms
    @property
    def dp_enabled(self) -> bool:
        """Data parallelism of any kind (replicate or shard)."""
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        """Any dimension the loss must be averaged over (data or context parallel)."""
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded, over dp_shard x cp (CP ranks hold distinct tokens)."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # ----------------------------------------------------------------------- derived sizes
    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same batch: cp x tp x pp."""
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """What seq_len must be a multiple of: sequence parallel splits it tp ways, and
        load-balanced context parallel splits it into 2 x cp chunks."""
        return self.tp * self.cp * 2

    @property
    def dense_params_mesh_ndim(self) -> int:
        """Mesh dimensions a dense (non-expert) parameter's DTensor spans."""
        return int(self.dp_replicate_enabled) + int(self.fsdp_enabled) + int(self.tp_enabled)

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        """Ranks a gradient is averaged over, also for experts sharded on a smaller mesh."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp_degree(self) -> int:
        """Number of distinct data shards the dataloader splits the data into."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int | None = None) -> int:
        """Which data shard ``rank`` (default: this process's rank) should load."""
        if rank is None:
            rank = _current_rank()
        if "dp" not in self.layout.flattened:
            self.layout._check_rank(rank)
            return 0
        return self.layout.local_rank("dp", rank)

    # ---------------------------------------------------------------------------- layout
    @cached_property
    def layout(self) -> MeshLayout:
        """The mesh recipe: dimension names and sizes, and the flattened sub-meshes."""
        if self.ep > 1:
            dp_shard_in_ep = self.ep // self.cp
            dims = {
                "pp": self.pp,
                "dp_replicate": self.dp_replicate,
                "dp_shard_mod_ep": self.dp_shard * self.cp // self.ep,
                "dp_shard_in_ep": dp_shard_in_ep,
                "cp": self.cp,
                "tp": self.tp,
            }
            kept = {n: d for n, d in dims.items() if d > 1 or n == "dp_shard_mod_ep"}
            shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
        else:
            dims = {
                "pp": self.pp,
                "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard,
                "cp": self.cp,
                "tp": self.tp,
            }
            kept = {n: d for n, d in dims.items() if d > 1}
            shard = ("dp_shard",)

        def present(*names: str) -> tuple[str, ...]:
            return tuple(n for n in names if n in kept)

        flattened = {
            "dp": present("dp_replicate", *shard),
            "dp_shard_cp": present(*shard, "cp"),
            "dp_cp": present("dp_replicate", *shard, "cp"),
        }
        if self.ep > 1:
            flattened["ep"] = present("dp_shard_in_ep", "cp")
        return MeshLayout(
            dim_names=tuple(kept),
            dim_sizes=tuple(kept.values()),
            flattened={name: srcs for name, srcs in flattened.items() if srcs},
        )

    # ----------------------------------------------------------------------- device mesh
    @property
    def world_mesh(self) -> DeviceMesh:
        """The full ``DeviceMesh``, built on first access together with every flattened
        sub-mesh (so all process groups are created at once, in the same order on every
        rank). Needs an initialized process group of ``world_size`` ranks."""
        if "" not in self._meshes:
            self._build_meshes()
        return self._meshes[""]

    def get_mesh(self, name: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by name: a dimension (``"tp"``), a flattened sub-mesh (``"dp_cp"``), or
        a tuple of names in mesh order (``("dp_replicate", "dp_shard_cp")`` for HSDP)."""
        root = self.world_mesh
        names = (name,) if isinstance(name, str) else tuple(name)
        for n in names:
            if n not in self.layout.names:
                raise ParallelDimsError(self._missing_mesh_message(n))
        if len(names) == 1 and names[0] in self._meshes:
            return self._meshes[names[0]]
        with warnings.catch_warnings():
            # Slicing a flattened dim from the root warns that it "will be deprecated", yet
            # it is the only way to get, e.g., HSDP's (dp_replicate, dp_shard_cp) mesh that
            # reuses the existing process groups; _unflatten would create new ones.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return root[names] if len(names) > 1 else root[names[0]]

    def _build_meshes(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from titan_dims.device import detect_device_type

        if not dist.is_available() or not dist.is_initialized():
            raise ParallelDimsError(
                "ParallelDims.world_mesh needs an initialized process group. Call "
                "titan_dims.init_distributed() first (under torchrun), or build it in one "
                "process with titan_dims.simulate(parallel_dims) for planning."
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise ParallelDimsError(
                f"ParallelDims was made for world_size={self.world_size}, but the process group "
                f"has {actual} ranks. Build it with world_size={actual}."
            )
        layout = self.layout
        device_type = self.device_type or detect_device_type()
        mesh = init_device_mesh(device_type, layout.dim_sizes, mesh_dim_names=layout.dim_names)
        # Keep our own references to flattened meshes: slicing a flattened name from the root
        # mesh is deprecated in torch.
        for name, sources in layout.flattened.items():
            self._meshes[name] = mesh[sources]._flatten(mesh_dim_name=name)
        self._meshes[""] = mesh

    def _missing_mesh_message(self, name: str) -> str:
        why = {
            "dp": "dp_replicate and dp_shard are both 1",
            "dp_shard_cp": "dp_shard and cp are both 1",
            "dp_cp": "dp_replicate, dp_shard and cp are all 1",
            "ep": "ep is 1",
        }
        known = ", ".join(self.layout.names) or "(none: a one-rank layout)"
        if name in why or name in _DEGREES:
            reason = why.get(name, f"{name} is 1 and degree-1 dimensions are left out")
            return (
                f"This layout has no {name!r} mesh because {reason}; check the matching "
                f"*_enabled property before asking for it. Meshes here: {known}."
            )
        return f"Unknown mesh name {name!r}. Meshes here: {known}."

    # ------------------------------------------------------------------------- reporting
    def __str__(self) -> str:
        degrees = ", ".join(f"{n}={getattr(self, n)}" for n in _DEGREES if getattr(self, n) > 1)
        return f"ParallelDims(world_size={self.world_size}: {degrees or 'one rank'})"

    def _suggestion(self) -> str:
        hint = suggest_degrees(
            self.world_size,
            {n: getattr(self, n) for n in _DEGREES if n != "dp_shard"},
        )
        text = ", ".join(f"{n}={v}" for n, v in hint.items() if v != 1 or n == "dp_shard")
        return f"A valid layout for world_size={self.world_size}: {text}."


def suggest_degrees(world_size: int, wanted: dict[str, int]) -> dict[str, int]:
    """The valid layout closest to ``wanted`` (degrees other than dp_shard): each degree is cut
    to the largest divisor of what is left of the world, pp first, and dp_shard takes the
    rest; ep is then cut to a valid value between cp and dp_shard x cp."""
    left = world_size
    result: dict[str, int] = {}
    for name in ("pp", "tp", "cp", "dp_replicate"):
        degree = _largest_divisor_at_most(left, max(1, wanted.get(name, 1)))
        result[name] = degree
        left //= degree
    result["dp_shard"] = left
    result["ep"] = 1
    if wanted.get("ep", 1) > 1:
        # Valid ep values are cp * k with k dividing dp_shard; keep the largest not above ep.
        cp = result["cp"]
        result["ep"] = cp * _largest_divisor_at_most(left, max(1, wanted["ep"] // cp))
    order = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    return {n: result[n] for n in order}


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raise ParallelDimsError(
        "No rank given and no process group is initialized; pass rank= explicitly."
    )
