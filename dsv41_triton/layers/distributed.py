"""The V4.1 attention layer under ``torch.distributed``: one process per GPU (or per CPU process
with gloo), each rank holding its TP shard, its own KV caches and its own selected backend.

    ctx = init_tp_from_env()                      # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    layer = build_tp_layer(cfg, layer_id, full_state_dict, ctx=ctx, backend="triton",
                           num_blocks=..., page_size=...)
    y = run_step(layer, step)                     # all-reduced [T, hidden], equal on every rank

Heads (``wq_b`` rows, ``attn_sink``) and whole ``wo_a`` groups are split by rank; ``wo_b`` is
row-parallel and its partial sums are all-reduced over ``ctx.group`` inside the layer
(``DeepseekV41Attention._reduce``): NCCL on GPUs, gloo on the CPU. ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set (unless already set) before NCCL initialises.

:func:`check_tp_against_tp1` runs a :class:`~dsv41_triton.layers.scenario.Scenario` at the
group's TP size and, on rank 0, the same steps through an in-process TP=1 layer, and compares
the layer outputs (relative Frobenius error, SPEC §7's 1e-2 for bf16 outputs).
:func:`launch_local` starts ``world_size`` local processes with torchrun's environment
(``torch.multiprocessing.spawn``), for tests without a ``torchrun`` command.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .config import DeepseekV41AttentionConfig
from .layer import DeepseekV41Attention
from .weights import shard_attention_state_dict
from .scenario import Scenario, ScenarioStep

#: set (setdefault) in every rank before NCCL initialises: no NVLink SHARP / multicast objects
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
#: SPEC §7: bf16 outputs within a relative Frobenius error of 1e-2
TP_REL_TOL = 1e-2


def set_nccl_env_defaults() -> None:
    """``os.environ.setdefault`` of :data:`NCCL_ENV_DEFAULTS` (call before NCCL initialises)."""
    for k, v in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl" or "gloo"
    group: Any = None  # the process group (``None``: the default group / no group at TP=1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise RuntimeError(f"{name} is not set: start the processes with torchrun "
                           "(or dsv41_triton.layers.distributed.launch_local)")
    try:
        return int(v)
    except ValueError:
        raise RuntimeError(f"{name}={v!r}: expected an int") from None


def init_tp_from_env(device: Union[str, torch.device, None] = None,
                     timeout_s: float = 600.0) -> TPContext:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    ``device``: ``"cuda"`` (default when CUDA is available: NCCL, ``cuda:LOCAL_RANK``, made
    current with ``torch.cuda.set_device``) or ``"cpu"`` (gloo). Already initialised: the
    existing default group is reused.
    """
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    kind = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        n = torch.cuda.device_count()
        if local >= n:
            raise RuntimeError(f"LOCAL_RANK={local} but only {n} CUDA device(s) are visible")
        set_nccl_env_defaults()
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    elif kind == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    if not dist.is_initialized():
        kw = {"device_id": dev} if kind == "cuda" else {}  # binds NCCL to this rank's GPU
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **kw)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError("a process group with another rank/size is already initialised")
    return TPContext(rank, world, local, dev, dist.get_backend(), dist.group.WORLD)


def shutdown_tp(barrier: bool = True) -> None:
    """Destroy the default process group if there is one; with ``barrier`` every rank first
    waits until all are past their last collective (a peer's socket closing under a live gloo
    group aborts the process)."""
    if dist.is_available() and dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the rank's layer and one step
# --------------------------------------------------------------------------------------------
def build_tp_layer(
    config: DeepseekV41AttentionConfig,
    layer_id: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    ctx: Optional[TPContext] = None,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
    device: Union[str, torch.device, None] = None,
    process_group: Any = None,
    backend: str = "auto",
    num_blocks: int,
    page_size: int,
    compressed_num_blocks: Optional[int] = None,
    compressed_page_size: Optional[int] = None,
    **layer_kw,
) -> DeepseekV41Attention:
    """The rank's layer: its shard of the full canonical ``state_dict`` (cut on the host by
    :func:`shard_attention_state_dict`, then moved), its backend, and its own KV caches.

    With ``ctx`` the rank, size, device and group come from it (explicit arguments win);
    ``tp_size == 1`` never reduces. ``layer_kw`` go to :class:`DeepseekV41Attention`
    (``fused``, ``max_model_len``, ``output_reduce``, ...).
    """
    if ctx is not None:
        tp_rank = ctx.rank if tp_rank is None else tp_rank
        tp_size = ctx.world_size if tp_size is None else tp_size
        device = ctx.device if device is None else device
        if process_group is None and tp_size > 1:
            process_group = ctx.group
    tp_rank = 0 if tp_rank is None else tp_rank
    tp_size = 1 if tp_size is None else tp_size
    shard = shard_attention_state_dict(state_dict, config, tp_rank, tp_size)
    layer = DeepseekV41Attention(config, layer_id, tp_rank=tp_rank, tp_size=tp_size,
                                 backend=backend, device=device,
                                 process_group=process_group if tp_size > 1 else None,
                                 **layer_kw)
    dev = layer.wq_b.weight.device
    layer.load_weights({k: v.to(dev) for k, v in shard.items()}, sharded=True)
    layer.allocate_kv_caches(num_blocks, page_size, compressed_num_blocks, compressed_page_size)
    return layer


def run_step(layer: DeepseekV41Attention, step: ScenarioStep) -> torch.Tensor:
    """One forward of ``step`` (its compressed KV and top-k only for a compressed layer):
    ``[T, hidden]`` bf16, reduced over the layer's group when it has one."""
    comp = layer.compress_ratio > 0
    return layer(None, step.hidden, step.metadata,
                 compressed_kv=step.compressed_kv if comp else None,
                 topk_indices=step.topk_indices if comp else None)


def ranks_agree(x: torch.Tensor, group: Any = None) -> bool:
    """True when ``x`` is bit-identical on every rank of ``group`` (collective; NaN counts as a
    disagreement)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return True
    xf = x.float()
    hi, lo = xf.clone(), xf.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    same = torch.tensor([float(torch.equal(hi, lo) and torch.equal(hi, xf))], device=x.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    return bool(same.item() == 1.0)


# --------------------------------------------------------------------------------------------
# TP=N vs TP=1
# --------------------------------------------------------------------------------------------
#: (plan, padding) steps: a prefill of several requests (one of 1 token), decodes with an idle
#: request and CUDA-graph padding, then a mixed step (a second chunk of D and a new request E)
DEFAULT_STEPS: Tuple[Tuple[Tuple[Tuple[str, int], ...], int], ...] = (
    ((("C", 1), ("A", 11), ("B", 6), ("D", 7)), 0),
    ((("A", 1), ("B", 1), ("C", 1), ("D", 0)), 0),
    ((("A", 1), ("B", 1), ("C", 1)), 2),
    ((("A", 1), ("C", 1), ("D", 6), ("E", 5)), 0),
)


@dataclass
class ScenarioSetup:
    """Cache geometry and input seed of a scenario run (identical on every rank)."""

    seed: int = 0
    num_blocks: int = 64
    page_size: int = 4
    compressed_page_size: int = 4
    blocks_per_req: int = 6
    max_model_len: int = 64
    chunk_size: int = 4

    def scenario(self, config, layer_id, device) -> Scenario:
        return Scenario(config, layer_id, seed=self.seed, num_blocks=self.num_blocks,
                        page=self.page_size, cpage=self.compressed_page_size,
                        blocks_per_req=self.blocks_per_req, device=device,
                        max_len=self.max_model_len)

    def layer(self, config, layer_id, state_dict, **kw) -> DeepseekV41Attention:
        return build_tp_layer(config, layer_id, state_dict, num_blocks=self.num_blocks,
                              page_size=self.page_size, compressed_num_blocks=self.num_blocks,
                              compressed_page_size=self.compressed_page_size,
                              max_model_len=self.max_model_len, **kw)


def run_scenario(layer: DeepseekV41Attention, scenario: Scenario, steps: Sequence,
                 chunk_size: int = 4) -> List[Tuple[ScenarioStep, torch.Tensor]]:
    """Run ``steps`` (``(plan, padding)`` pairs) through ``layer``; ``[(step, output)]``."""
    out = []
    for plan, padding in steps:
        st = scenario.step(list(plan), padding, chunk_size)
        out.append((st, run_step(layer, st)))
    return out


@dataclass
class TPCheck:
    """What :func:`check_tp_against_tp1` found (errors filled on rank 0 only)."""

    tp_size: int
    rel_errs: List[float] = field(default_factory=list)  # per step, real tokens
    padding_zero: bool = True  # padding tokens' outputs are exactly 0
    ranks_agree: bool = True  # every rank holds the same output
    tol: float = TP_REL_TOL
    layer: Optional[DeepseekV41Attention] = None  # the rank's TP layer (after the steps)
    reference: Optional[DeepseekV41Attention] = None  # rank 0's TP=1 layer
    steps: List[ScenarioStep] = field(default_factory=list)

    @property
    def max_rel_err(self) -> float:
        return max(self.rel_errs, default=0.0)

    @property
    def ok(self) -> bool:
        return self.ranks_agree and self.padding_zero and self.max_rel_err <= self.tol

    def summary(self) -> Dict[str, Any]:
        return {"tp": self.tp_size, "ok": self.ok, "max_rel_err": self.max_rel_err,
                "rel_errs": self.rel_errs, "ranks_agree": self.ranks_agree,
                "padding_zero": self.padding_zero}


def check_tp_against_tp1(
    ctx: TPContext,
    config: DeepseekV41AttentionConfig,
    layer_id: int,
    *,
    backend: str = "auto",
    steps: Sequence = DEFAULT_STEPS,
    setup: Optional[ScenarioSetup] = None,
    weights_seed: int = 0,
    skip_reduce: bool = False,
    reference: bool = True,
    reference_backend: Optional[str] = None,
    **layer_kw,
) -> TPCheck:
    """Collective. Every rank builds the same random full weights (``weights_seed``) and the
    same steps (``setup.seed``) and runs them through its TP shard (the all-reduce inside the
    layer); rank 0 also runs them through a TP=1 layer on its device (``reference_backend``,
    default ``backend``) and compares each step's outputs on the real tokens.

    ``skip_reduce=True`` leaves each rank with its partial sum (a broken TP layer: the check
    must then fail, which is how tests show it can). ``reference=False`` skips the TP=1 layer
    (no errors are computed; ``ok`` then only reflects the ranks' agreement).
    """
    from ..testing import rel_err
    from .weights import random_attention_state_dict

    setup = setup or ScenarioSetup()
    sd = random_attention_state_dict(config, seed=weights_seed)
    kw = dict(layer_kw)
    if skip_reduce:
        kw["output_reduce"] = lambda y: y
    layer = setup.layer(config, layer_id, sd, ctx=ctx, backend=backend, **kw)
    res = TPCheck(ctx.world_size, layer=layer)
    outs = run_scenario(layer, setup.scenario(config, layer_id, ctx.device), steps,
                        setup.chunk_size)
    res.steps = [st for st, _ in outs]
    agree = [ranks_agree(y, ctx.group) for _, y in outs]
    res.ranks_agree = all(agree)
    if ctx.is_main and reference:
        ref = setup.layer(config, layer_id, sd, tp_rank=0, tp_size=1, device=ctx.device,
                          backend=reference_backend or backend, **layer_kw)
        res.reference = ref
        ref_outs = run_scenario(ref, setup.scenario(config, layer_id, ctx.device), steps,
                                setup.chunk_size)
        for (st, y), (_, y1) in zip(outs, ref_outs):
            n = len(st.owners)
            res.rel_errs.append(rel_err(y[:n], y1[:n]) if n else 0.0)
            res.padding_zero &= bool((y[n:] == 0).all())
    return res


# --------------------------------------------------------------------------------------------
# local launcher (tests)
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: seconds a rank waits at launch_local's exit barriers for its peers
EXIT_BARRIER_TIMEOUT_S = 300.0


def _spawn_entry(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple,
                 env: Dict[str, str], done) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        fn(*args)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        # every rank is past its last collective before any tears its group down, and every
        # group is down before any process exits (a peer's socket closing under a live gloo
        # group, or gloo's threads met by the interpreter's teardown, abort the process)
        done.wait(EXIT_BARRIER_TIMEOUT_S)
        shutdown_tp(barrier=False)
        done.wait(EXIT_BARRIER_TIMEOUT_S)
    except BaseException:
        shutdown_tp(barrier=False)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown: fn's results are written, the group is gone


def launch_local(fn: Callable, world_size: int, args: tuple = (),
                 env: Optional[Mapping[str, str]] = None) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes on this machine with torchrun's
    environment set (``fn`` then calls :func:`init_tp_from_env`) plus ``env``; raises if any
    rank fails. ``fn`` must be importable (a module-level function); when it returns on every
    rank, the ranks meet, destroy the default process group, meet again and exit (without the
    interpreter's teardown)."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    done = mp.get_context("spawn").Barrier(world_size)
    mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, tuple(args), dict(env or {}),
                                 done), nprocs=world_size, join=True)


__all__ = [
    "DEFAULT_STEPS",
    "NCCL_ENV_DEFAULTS",
    "ScenarioSetup",
    "TPCheck",
    "TPContext",
    "TP_REL_TOL",
    "build_tp_layer",
    "check_tp_against_tp1",
    "free_port",
    "init_tp_from_env",
    "launch_local",
    "ranks_agree",
    "run_scenario",
    "run_step",
    "set_nccl_env_defaults",
    "shutdown_tp",
]
