"""The trainer's parallel degrees and which rank does what: `ParallelDims`, the one place that knows (STYLE 18, 22).

What: trainer.parallel (areal_mq/algorithms/config.py `ParallelConfig`) names four degrees whose product is the
trainer's ranks (launcher.trainer_ranks), torchtitan's names and order:

    dp_replicate  whole copies of the model; gradients all-reduced across them (DDP, or HSDP's replica groups)
    dp_shard      ranks one copy's parameters, gradients and AdamW state are sharded over (FSDP2)
    cp            context parallelism: ranks that split one sequence's tokens  (Ulysses, algorithms/ulysses.py)
    tp            tensor parallelism: ranks that split each layer's matrices   (algorithms/tensor_parallel.py)

A rank's place in the mesh, tp innermost (a tp group is consecutive ranks: one node's GPUs under torchrun):

    position = ((r x dp_shard + s) x cp + c) x tp + t      r, s, c, t: the rank's index along each dim

The position is the rank, except under a mesh over several hosts, where the ranks of one host are put next to each
other first (`host_order`: a Ray placement group may interleave them), so a shard group stays on a node.

`map_degrees(cfg)` (TrainerConfig's validator) resolves trainer.parallel and the older trainer.strategy /
trainer.fsdp.replicate against each other (the rules are in ParallelConfig's description); `check_ranks(cfg, n)`
(RunConfig's) holds the degrees to launcher.trainer_ranks. `ParallelDims.of(cfg, world)` resolves a -1 degree and
checks the product, then answers every "which rank does what":
  - `room`: which strategy module builds and wraps the model (areal_mq/algorithms/strategy.py): ddp when the only
    degree above 1 is dp_replicate, else fsdp; `sharded` says the same as a bool;
  - the batch: `dp` (the data-parallel world the batch is split over) and `dp_rank(rank)` (ranks of one cp x tp
    group train the same sequences); `lockstep` (every rank must run the busiest rank's forward count);
    `counts_metrics(rank)` (whose step sums enter the world-wide metric sum: tp index 0, so each token once);
  - publishing: `gathers_collectively` (every rank joins a full snapshot), `publish_group(rank)` ((index, count)
    among the ranks that serve sharded weights, or None);
  - checkpoints: `writes_main(rank)` (the config, tokenizer, scheduler and JSON state, which records the degrees;
    what every rank writes under sharded/ is its strategy's `save_shards`, areal_mq/algorithms/checkpoint.py);
  - plan (areal_mq/launch/plan.py): `shard_ranks` (ranks a decoder layer's 16 bytes a parameter are split over:
    dp_shard x tp), `activation_ranks` (ranks one micro-batch's activations are split over: tp x cp), `describe()`;
  - `mesh(device)`: the DeviceMesh, dims named dp_replicate, dp_shard, cp, tp (device type from the device: cpu
    with gloo, cuda with nccl), made once; `dp_mesh()`: its slice FSDP2 shards over (never cp: the cp ranks of a
    pair hold the same shards, their gradients summed by ulysses.reduce_cp_grads); `cp_group()`: the cp group.
`refuse_under_tp(cfg)` (TrainerConfig's validator) refuses what tensor parallelism cannot do yet (LoRA, sharded
publishing); `refuse_unwired(cfg)` is the trainer's start: what no room trains yet (tp and cp together, cp with
CPU offload).
Importing this module imports no torch (the CLI and `plan` read it).
"""
from __future__ import annotations

import math
from typing import Any

from areal_mq.errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dims, outermost first
ROOMS = ("ddp", "fsdp")  # the strategy modules (areal_mq/algorithms/strategy.py STRATEGIES)
WHY = {"ddp": "every rank a whole copy: only dp_replicate is above 1",
       "fsdp": "dp_shard other than 1, or tp or cp above 1, split the model"}


def room_of(parallel: Any) -> str:
    """The strategy module degrees need: fsdp when anything is split (dp_shard other than 1, tp or cp above 1)."""
    return ROOMS[int(parallel.dp_shard != 1 or parallel.tp > 1 or parallel.cp > 1)]


def _legacy(cfg: Any) -> Any:
    """trainer.parallel as the older keys say it: ddp = every rank a whole copy; fsdp = fsdp.replicate copies, each
    sharded over the ranks left."""
    degrees = type(cfg.parallel)  # config.py's ParallelConfig (the default's class: this module imports no config)
    made = {"ddp": lambda: degrees(dp_replicate=-1, dp_shard=1),
            "fsdp": lambda: degrees(dp_replicate=cfg.fsdp.replicate, dp_shard=-1)}[cfg.strategy]()
    made._source = (f"trainer.strategy {cfg.strategy}" +
                    (f" with trainer.fsdp.replicate {cfg.fsdp.replicate}" if made.dp_shard == -1 else ""))
    return made


def map_degrees(cfg: Any) -> None:
    """Resolve `cfg.parallel` and `cfg.strategy` (a TrainerConfig) against each other, in place: either may be given,
    both only when they agree. Raises ValueError (pydantic reports it under trainer)."""
    given = cfg.model_fields_set
    if "parallel" not in given:
        cfg.parallel = _legacy(cfg)
        return
    p, room = cfg.parallel, room_of(cfg.parallel)
    if "strategy" in given and cfg.strategy != room:
        raise ValueError(f"trainer.strategy {cfg.strategy!r} contradicts trainer.parallel {p.degrees()}, which is "
                         f"{room} ({WHY[room]}); "
                         "give trainer.parallel alone (trainer.strategy is derived from it), or make them agree")
    replicate = cfg.fsdp.replicate
    if p.shards and replicate != 1 and replicate != p.dp_replicate:
        raise ValueError(f"trainer.fsdp.replicate {replicate} contradicts trainer.parallel.dp_replicate "
                         f"{p.dp_replicate}: give trainer.parallel.dp_replicate alone")
    cfg.strategy = room


def degrees(parallel: Any, world: int) -> tuple[tuple[int, int, int, int], str | None]:
    """((dp_replicate, dp_shard, cp, tp) for `world` ranks, the error or None). A -1 degree takes the ranks the
    others leave; where they do not divide `world`, the error says so and the degrees are the nearest that run
    (plan still counts a layout it refuses)."""
    fixed = {d: getattr(parallel, d) for d in DIMS}
    free = [d for d, v in fixed.items() if v == -1]
    known = math.prod(v for v in fixed.values() if v != -1)
    source = getattr(parallel, "_source", "trainer.parallel")
    error = None
    if free:
        fixed[free[0]] = max(1, world // known)
        if world % known and source != "trainer.parallel":  # the older keys: only fsdp.replicate can fail to divide
            error = (f"trainer.fsdp.replicate {parallel.dp_replicate} does not divide launcher.trainer_ranks "
                     f"{world}: HSDP makes `replicate` groups of trainer_ranks / replicate ranks; set one to a "
                     "multiple of the other (ranks / replicate = the GPUs of one node)")
        elif world % known:
            error = (f"{source} {parallel.degrees()} needs a multiple of {known} ranks to fill {free[0]}, and the "
                     f"trainer has {world} (launcher.trainer_ranks): change the degrees or the ranks")
    elif known != world:
        error = (f"{source} {parallel.degrees()} multiplies to {known} ranks, and the trainer has {world} "
                 f"(launcher.trainer_ranks): make the product equal the ranks, or give one of dp_replicate, dp_shard "
                 "as -1 (the ranks the others leave)")
    return tuple(fixed[d] for d in DIMS), error


def check_ranks(cfg: Any, ranks: int) -> None:
    """RunConfig's check: trainer.parallel, as written, against launcher.trainer_ranks (ConfigError naming both). The
    older keys keep their old check: `plan` refuses an fsdp.replicate that does not divide the ranks."""
    if getattr(cfg.parallel, "_source", "trainer.parallel") != "trainer.parallel":
        return
    _, error = degrees(cfg.parallel, ranks)
    if error:
        raise ConfigError(error)


def refuse_under_tp(cfg: Any) -> None:
    """TrainerConfig's check (no torch): what tp > 1 cannot do yet, with the reason. Raises ValueError.
    - LoRA: PEFT wraps each target Linear (base_layer + lora_A + lora_B), so the tp plan's module paths no longer
      name an nn.Linear, and a correct split needs per-adapter placements (colwise target: A replicated, B split by
      columns; rowwise target: A split by rows, B replicated) plus an adapter gather for publishing and
      checkpoints; none of that exists.
    - publish_layout sharded: weights/sharded.py's WeightsShard carries each rank's dim-0 ROW range of a tensor,
      while a RowwiseParallel weight's tp shard (o_proj, down_proj) is a column block (Shard(1)) no row range
      describes (and a ColwiseParallel one is placed by FSDP's _StridedShard, which fsdp.local_slices does not
      read). auto resolves to gather under tp (TrainerConfig.sharded_publish)."""
    tp = cfg.parallel.tp
    if tp > 1 and cfg.lora is not None:
        raise ValueError(f"trainer.lora with trainer.parallel.tp {tp}: LoRA under tensor parallelism is not supported "
                         "(PEFT's wrapped layers have no tp plan, and the adapter would need its own placements); "
                         "train LoRA with tp 1 (dp_shard shards the adapter already)")
    if tp > 1 and cfg.publish_layout == "sharded":
        raise ValueError(f"trainer.publish_layout sharded with trainer.parallel.tp {tp}: a tp shard of o_proj / "
                         "down_proj is a column block, not the dim-0 row slice a WeightsShard describes; use "
                         "publish_layout gather or auto (auto gathers under tp > 1)")


def refuse_unwired(cfg: Any) -> None:
    """The trainer's start (before anything is built; `cfg` a TrainerConfig): what no room trains yet."""
    p = cfg.parallel
    if p.tp > 1 and p.cp > 1:
        raise ConfigError(f"trainer.parallel tp {p.tp} with cp {p.cp}: tensor and context parallelism together are "
                          "not built yet (Ulysses would split the heads each tp rank keeps, untested); use one of "
                          "them, beside dp_replicate / dp_shard")
    if p.cp > 1 and cfg.fsdp.offload:
        raise ConfigError(f"trainer.parallel.cp {p.cp} with trainer.fsdp.offload: the cp ranks' gradients are summed "
                          "by an all-reduce of the device's shards (ulysses.reduce_cp_grads), and offload keeps them "
                          "in host memory; turn offload off or use cp 1")


def host_order(hosts: list[str]) -> list[int]:
    """Every rank, those of one host (`hosts[rank]`) next to each other, hosts in the order of their lowest rank,
    so rank 0 stays first. torchrun numbers a node's ranks consecutively already; a Ray placement group may not,
    so the mesh is laid out from where the ranks really are."""
    first: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first.setdefault(host, rank)
    return sorted(range(len(hosts)), key=lambda r: (first[hosts[r]], r))


class ParallelDims:
    """The resolved degrees of one trainer and everything that follows from them (the module docstring)."""

    def __init__(self, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1, *,
                 room: str | None = None, source: str = "trainer.parallel"):
        for name, v in zip(DIMS, (dp_replicate, dp_shard, cp, tp)):
            if v < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {v}")
        self.dp_replicate, self.dp_shard, self.cp, self.tp = dp_replicate, dp_shard, cp, tp
        self.room = room or room_of(self)
        self.source = source
        self.world = dp_replicate * dp_shard * cp * tp
        self.order = list(range(self.world))  # mesh position -> rank (`host_order` under a mesh over hosts)
        self._mesh: Any = None

    @classmethod
    def of(cls, cfg: Any, world: int) -> "ParallelDims":
        """The degrees of `cfg` (a TrainerConfig) over `world` ranks; ConfigError where they do not fill them."""
        (r, s, c, t), error = degrees(cfg.parallel, world)
        if error:
            raise ConfigError(error)
        return cls(r, s, c, t, room=cfg.strategy, source=getattr(cfg.parallel, "_source", "trainer.parallel"))

    # ---------------------------------------------------------------- sizes
    @property
    def sharded(self) -> bool:
        """Whether no rank holds a whole model (the fsdp room: FSDP2, with TP or Ulysses CP beside it)."""
        return self.room == ROOMS[1]

    @property
    def dp(self) -> int:
        """The data-parallel world: how many shares a step's batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_ranks(self) -> int:
        """Ranks a decoder layer's parameters, gradients and AdamW state are split over (dp_shard x tp)."""
        return self.dp_shard * self.tp

    @property
    def activation_ranks(self) -> int:
        """Ranks one micro-batch's activations are split over: tp splits the hidden widths, cp the sequence."""
        return self.tp * self.cp

    def degrees(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def describe(self) -> str:
        """The layout in a few words, as `plan` prints it: ddp, fsdp over 8, HSDP 2 x 4, with tp and cp after."""
        if not self.sharded:
            return "ddp"
        more = "".join(f" x {d} {getattr(self, d)}" for d in ("tp", "cp") if getattr(self, d) > 1)
        if self.dp_replicate == 1:
            return f"fsdp over {self.dp_shard}{more}"
        return f"HSDP {self.dp_replicate} x {self.dp_shard}{more}: shards within a group, replicas across"

    # ---------------------------------------------------------------- which rank does what
    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each dim (from its mesh position)."""
        pos, out = self.order.index(rank), {}
        for d in reversed(DIMS):
            size = getattr(self, d)
            out[d], pos = pos % size, pos // size
        return {d: out[d] for d in DIMS}

    def dp_rank(self, rank: int) -> int:
        """`rank`'s share of the batch (0 .. dp - 1): the ranks of one cp x tp group get the same share."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def counts_metrics(self, rank: int) -> bool:
        """Whether `rank`'s step sums (loss, token counts, ...) enter the world-wide metric sum: the tp ranks of a
        group compute the same tokens, so only tp index 0 counts them; cp ranks compute disjoint tokens and all
        count (each token once)."""
        return self.coords(rank)["tp"] == 0

    @property
    def lockstep(self) -> bool:
        """Every rank must run the busiest rank's micro-batch count: a sharded model's forwards are collectives."""
        return self.sharded and self.world > 1

    @property
    def gathers_collectively(self) -> bool:
        """A full snapshot is gathered tensor by tensor with every rank taking part (else rank 0 holds it)."""
        return self.sharded

    def publish_group(self, rank: int) -> tuple[int, int] | None:
        """(index, count) of `rank` among the ranks that serve sharded weights: the first replica group's (it holds
        rank 0 as index 0) ranks of cp index 0, which hold every piece of one copy once; None: `rank` serves nothing
        and never waits on a publish (another replica, another cp rank, or a trainer whose ranks hold whole copies)."""
        if not self.sharded:
            return None
        c = self.coords(rank)
        if c["dp_replicate"] or c["cp"]:
            return None
        return c["dp_shard"] * self.tp + c["tp"], self.shard_ranks

    def writes_main(self, rank: int) -> bool:
        """Whether `rank` writes a checkpoint's single files (config, tokenizer, scheduler, JSON state): rank 0."""
        return rank == 0

    # ---------------------------------------------------------------- the mesh
    def mesh(self, device: Any) -> Any:
        """The DeviceMesh over every rank (collective the first time: each rank calls it), dims named DIMS, laid out
        host by host (`host_order`); a warning names a shard group that must span hosts."""
        if self._mesh is not None:
            return self._mesh
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if dist.get_world_size() != self.world:
            raise ConfigError(f"{self.source} {self.degrees()} is {self.world} ranks and the process group has "
                              f"{dist.get_world_size()}: set launcher.trainer_ranks to {self.world}")
        if self.world > 1 and self.dp_replicate > 1:
            import socket

            hosts: list[Any] = [None] * self.world
            dist.all_gather_object(hosts, socket.gethostname())  # once, at build time
            self.order = host_order(hosts)
            if dist.get_rank() == 0:
                self._warn_spans(hosts)
        shape = tuple(getattr(self, d) for d in DIMS)
        layout = torch.tensor(self.order, dtype=torch.int64).view(shape)
        self._mesh = DeviceMesh(device.type, layout, mesh_dim_names=DIMS)
        return self._mesh

    def dp_mesh(self) -> Any:
        """The slice of the mesh FSDP2 shards over: dp_shard (1-D), or (dp_replicate, dp_shard) for HSDP."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.dp_mesh() before mesh(device)")
        return self._mesh["dp_shard"] if self.dp_replicate == 1 else self._mesh["dp_replicate", "dp_shard"]

    def cp_group(self) -> Any:
        """The process group of `rank`'s cp ranks (they split one packed row: algorithms/ulysses.py), None at cp 1
        (every Ulysses step then a no-op). After mesh(device)."""
        if self.cp == 1:
            return None
        if self._mesh is None:
            raise RuntimeError("ParallelDims.cp_group() before mesh(device)")
        return self._mesh["cp"].get_group()

    def _warn_spans(self, hosts: list[str]) -> None:
        import logging

        per = self.world // self.dp_replicate
        rows = [self.order[i:i + per] for i in range(0, self.world, per)]
        spans = [row for row in rows if len({hosts[r] for r in row}) > 1]
        if spans:
            logging.getLogger(__name__).warning(
                "HSDP shard groups %s span hosts (%s): their all-gathers cross nodes; make launcher.trainer_ranks / "
                "dp_replicate divide the ranks each node holds", spans[:2], sorted(set(hosts)))
