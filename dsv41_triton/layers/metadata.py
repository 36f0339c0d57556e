"""Per-step metadata of the V4.1 attention layer, built from a plain description of the step.

A step is a list of :class:`RequestSpec` (prefix length, new tokens, block tables), decodes
first (requests with ``query_len <= decode_threshold``), then prefills, as in vLLM's reordered
batch. :func:`build_step_metadata` produces everything the kernels need (all on ``device``):

* token layout: ``positions`` (int64), ``query_start_loc``, ``seq_lens``, ``token_to_req``,
  ``is_valid_token`` (False for padding tokens appended to pure-decode steps);
* the window cache: ``swa_slot_mapping`` (where each token's KV record goes), the request
  ``swa_block_table``, per decode token ``decode_swa_indices [Td, W]`` (slot ids of positions
  ``max(pos - W + 1, 0) .. pos`` ascending, ``-1`` after) and ``decode_swa_lens``;
* prefill: ``prefill_seq_lens``, ``prefill_gather_lens`` (``query_len + min(prefix, W - 1)``:
  the raw tokens the window of the request's first new token needs) and, per compress ratio,
  the chunk plan: at most ``prefill_chunk_size`` (4) requests per chunk, with workspace rows
  ``N`` (the chunk's largest compressed count ``seq_len // r``, 0 for window-only layers) and
  ``M = N + max gather_len`` (SPEC §5: compressed rows at ``M*b + t``, window rows at
  ``M*b + N + ..``);
* per compressed cache (one per ratio ``r > 0``): its ``block_table``, page size and
  ``slot_mapping`` (the token at ``pos`` completes entry ``pos // r`` when ``(pos + 1) % r == 0``;
  other tokens ``-1``).

Host-side copies (``*_cpu`` lists) carry what the layer needs to loop over chunks without a
device sync; so do ``swa_max_block_id`` / ``CompressedMetadata.max_block_id`` (the largest block
id of each cache's tables), which the layer checks against the caches it has bound.

Block tables are host data (lists or CPU tensors of ints) and are checked here: every entry is
an integer ``>= -1``; the blocks that cover the request's positions (``0 .. seq_len - 1``, or
its entries ``0 .. seq_len // r - 1`` for a compressed cache) must be real blocks (``>= 0``);
``-1`` only pads the table past them.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _MappingABC
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from .._contract import check_device
from .._utils import cdiv, check_int

IntSeq = Union[Sequence[int], torch.Tensor]
#: block tables are int32 tensors
_MAX_BLOCK_ID = 2**31 - 1


@dataclass
class RequestSpec:
    """One request of a step.

    query_len: tokens computed this step (0 allowed: the request is carried but idle).
    prefix_len: tokens already in the caches (computed in earlier steps).
    swa_block_table: block ids of the window cache covering positions ``0 .. seq_len - 1``
        (position ``p`` lives in block ``swa_block_table[p // page]``): a sequence of ints or
        a 1-D integer tensor; the covering blocks ``>= 0``, ``-1`` only after them (padding).
    compressed_block_tables: ``{ratio: block ids}`` of each compressed cache (entry ``e``
        in block ``table[e // compressed_page]``), the same way.
    """

    query_len: int
    prefix_len: int = 0
    swa_block_table: IntSeq = ()
    compressed_block_tables: Mapping[int, IntSeq] = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.query_len


class PrefillChunk(NamedTuple):
    """Requests ``[req_start, req_end)`` of the batch (absolute request indices), their tokens
    ``[tok_start, tok_end)`` (absolute token indices), and the workspace geometry ``N``/``M``."""

    req_start: int
    req_end: int
    tok_start: int
    tok_end: int
    N: int
    M: int


@dataclass
class CompressedMetadata:
    """One compressed cache (ratio ``r > 0``)."""

    ratio: int
    page_size: int
    block_table: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64
    num_entries_cpu: List[int]  # seq_len // r per request
    #: host int: the largest block id of ``block_table`` (-1 when none); None: unknown (not
    #: checked against the bound cache)
    max_block_id: Optional[int] = None


@dataclass
class StepMetadata:
    num_reqs: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int  # padding tokens included
    num_prefill_tokens: int
    num_tokens: int
    window_size: int
    swa_page_size: int
    max_position: int  # host int: largest position of the step (-1 when no token)
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    token_to_req: torch.Tensor  # [T] int32
    is_valid_token: torch.Tensor  # [T] bool
    swa_block_table: torch.Tensor  # [B, max_blocks] int32
    swa_slot_mapping: torch.Tensor  # [T] int64
    decode_swa_indices: torch.Tensor  # [Td, W] int32
    decode_swa_lens: torch.Tensor  # [Td] int32
    prefill_seq_lens: torch.Tensor  # [P] int32
    prefill_gather_lens: torch.Tensor  # [P] int32
    query_start_loc_cpu: List[int]
    seq_lens_cpu: List[int]
    prefill_gather_lens_cpu: List[int]
    compressed: Dict[int, CompressedMetadata]
    prefill_chunk_size: int
    max_workspace_rows: Optional[int]
    #: host int: the largest block id of ``swa_block_table`` (-1 when none); None: unknown (not
    #: checked against the bound cache)
    swa_max_block_id: Optional[int] = None
    _plans: Dict[int, List[PrefillChunk]] = field(default_factory=dict)
    _all_entries: Dict[int, torch.Tensor] = field(default_factory=dict)
    #: scratch a backend keeps for the step's layers (e.g. FlashMLA's scheduler metadata);
    #: clear it when this object's tensors are refilled for another step
    backend_cache: Dict[object, object] = field(default_factory=dict)

    def all_entries_topk(self, compress_ratio: int, multiple: int = 64) -> torch.Tensor:
        """``[T, K]`` int32 "top-k" rows of a layer without an indexer (HCA): each token's
        every completed compressed entry (:func:`completed_entries_topk`). ``K`` is the step's
        largest entry count rounded up to ``multiple`` (host data, no device sync); the tensor
        is built once per ratio and shared by the step's layers."""
        check_int("compress_ratio", compress_ratio, lo=1)
        if compress_ratio not in self._all_entries:
            if compress_ratio in self.compressed:
                n = max(self.compressed[compress_ratio].num_entries_cpu, default=0)
            else:
                n = max(self.seq_lens_cpu, default=0) // compress_ratio
            width = max(cdiv(max(n, 1), multiple) * multiple, 1)
            self._all_entries[compress_ratio] = completed_entries_topk(
                self.positions, compress_ratio, width, self.is_valid_token)
        return self._all_entries[compress_ratio]

    def chunk_plan(self, compress_ratio: int) -> List[PrefillChunk]:
        """The prefill chunks for a layer of ``compress_ratio`` (cached per ratio)."""
        if compress_ratio not in self._plans:
            self._plans[compress_ratio] = plan_prefill_chunks(
                self.seq_lens_cpu[self.num_decodes:],
                self.prefill_gather_lens_cpu,
                self.query_start_loc_cpu,
                self.num_decodes,
                compress_ratio,
                self.prefill_chunk_size,
                self.max_workspace_rows,
            )
        return self._plans[compress_ratio]


def completed_entries_topk(positions: torch.Tensor, compress_ratio: int, width: int,
                           is_valid_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T, width]`` int32: row ``t`` is ``0, 1, .., n_t - 1`` then ``-1``, with
    ``n_t = (positions[t] + 1) // compress_ratio`` the entries completed at or before the token
    (all ``-1`` for invalid tokens). What a layer without an indexer attends to."""
    check_int("compress_ratio", compress_ratio, lo=1)
    check_int("width", width, lo=1)
    n = torch.div(positions.to(torch.int64) + 1, compress_ratio, rounding_mode="floor")
    if is_valid_token is not None:
        n = torch.where(is_valid_token, n, torch.zeros_like(n))
    cols = torch.arange(width, device=positions.device, dtype=torch.int64)
    rows = torch.where(cols[None, :] < n[:, None], cols[None, :], torch.full_like(cols, -1)[None, :])
    return rows.to(torch.int32)


def plan_prefill_chunks(
    prefill_seq_lens: Sequence[int],
    prefill_gather_lens: Sequence[int],
    query_start_loc: Sequence[int],
    num_decodes: int,
    compress_ratio: int,
    prefill_chunk_size: int = 4,
    max_workspace_rows: Optional[int] = None,
) -> List[PrefillChunk]:
    """Group consecutive prefill requests into chunks of at most ``prefill_chunk_size``
    requests (and, when given, at most ``max_workspace_rows`` = chunk requests × ``M``; a
    single request always forms a chunk). ``N = max(seq_len // r)`` (0 when ``r == 0``),
    ``M = N + max(gather_len)``."""
    check_int("prefill_chunk_size", prefill_chunk_size, lo=1)
    check_max_workspace_rows(max_workspace_rows)
    P = len(prefill_seq_lens)
    plan: List[PrefillChunk] = []
    s = 0
    while s < P:
        n = prefill_seq_lens[s] // compress_ratio if compress_ratio > 0 else 0
        g = prefill_gather_lens[s]
        e = s + 1
        while e < P and e - s < prefill_chunk_size:
            n2 = max(n, prefill_seq_lens[e] // compress_ratio if compress_ratio > 0 else 0)
            g2 = max(g, prefill_gather_lens[e])
            if max_workspace_rows is not None and (e - s + 1) * (n2 + g2) > max_workspace_rows:
                break
            n, g, e = n2, g2, e + 1
        plan.append(PrefillChunk(num_decodes + s, num_decodes + e,
                                 query_start_loc[num_decodes + s], query_start_loc[num_decodes + e],
                                 n, n + g))
        s = e
    return plan


def _table(rows: List[List[int]], device) -> torch.Tensor:
    width = max([len(r) for r in rows] + [1])
    t = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if len(r):
            t[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int32)
    return t.to(device)


def check_max_workspace_rows(v: object, name: str = "max_workspace_rows") -> Optional[int]:
    """``max_workspace_rows`` (named ``name`` in the error): None (no budget) or an int >= 1."""
    if v is not None:
        check_int(name, v, lo=1)
    return v


def _as_list(name: str, v: IntSeq) -> List[int]:
    """A block table as a list of Python ints: a sequence of integers (``int``, numpy integers,
    0-d integer tensors; not bools, floats or strings) or a 1-D integer tensor."""
    if isinstance(v, torch.Tensor):
        if v.dtype == torch.bool or v.dtype.is_floating_point or v.dtype.is_complex:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {v.dtype}")
        if v.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(v.shape)}")
        return v.tolist()
    if isinstance(v, (str, bytes, _MappingABC)) or not isinstance(v, _Iterable):
        raise TypeError(f"{name}: expected a sequence of ints or a 1-D integer tensor, got "
                        f"{type(v).__name__}")
    v = list(v)
    if all(type(x) is int for x in v):  # the common case (bool is not int here)
        return v
    out = []
    for i, x in enumerate(v):
        try:
            if isinstance(x, bool):
                raise TypeError
            out.append(operator.index(x))
        except TypeError:
            raise TypeError(f"{name}[{i}]: expected an int block id, got {x!r} "
                            f"({type(x).__name__})") from None
    return out


def _check_blocks(name: str, table: List[int], need: int, what: str) -> int:
    """Entries in ``[-1, 2**31)`` (the tables are int32); the first ``need`` (the blocks that
    hold ``what``) ``>= 0``. Returns the largest id (-1 when none)."""
    if not table:
        return -1
    hi = max(table)
    if hi > _MAX_BLOCK_ID or min(table) < -1 or (need and min(table[:need]) < 0):
        for i, b in enumerate(table):
            if b < -1 or b > _MAX_BLOCK_ID:
                raise ValueError(f"{name}[{i}]: block id {b}; expected a block id in "
                                 f"[0, {_MAX_BLOCK_ID}], or -1 (padding after the blocks in use)")
            if b < 0 and i < need:
                raise ValueError(f"{name}[{i}]: block id -1 for a block in use; the first "
                                 f"{need} block(s) hold {what} and must be real blocks (>= 0); "
                                 "-1 only pads the table after them")
    return hi


def _device(device: object) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    return check_device(device)


def build_step_metadata(
    requests: Sequence[RequestSpec],
    *,
    window_size: int,
    swa_page_size: int,
    compressed_page_sizes: Optional[Mapping[int, int]] = None,
    decode_threshold: int = 1,
    num_padding_tokens: int = 0,
    prefill_chunk_size: int = 4,
    max_workspace_rows: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
) -> StepMetadata:
    """Build a :class:`StepMetadata` (see the module docstring).

    compressed_page_sizes: ``{ratio: entries per page}`` of each compressed cache the step's
        layers use; every request must then give a block table for that ratio.
    num_padding_tokens: invalid tokens appended after the real ones (CUDA-graph padding of a
        pure-decode step): position 0, slot -1, ``is_valid_token`` False, no keys.
    prefill_chunk_size / max_workspace_rows: the chunk plan's limits (an int >= 1; None: no
        row budget), checked here although the plan is built on first use.
    device: where the tensors go (the layer's device).

    Every argument is checked before anything is built (``TypeError`` / ``ValueError`` naming
    it); block tables as the module docstring says.
    """
    check_int("window_size", window_size, lo=1)
    check_int("swa_page_size", swa_page_size, lo=1)
    check_int("decode_threshold", decode_threshold, lo=1)
    check_int("num_padding_tokens", num_padding_tokens, lo=0)
    check_int("prefill_chunk_size", prefill_chunk_size, lo=1)
    check_max_workspace_rows(max_workspace_rows)
    dev = _device(device)
    if compressed_page_sizes is not None and not isinstance(compressed_page_sizes, _MappingABC):
        raise TypeError(f"compressed_page_sizes: expected a mapping {{ratio: page size}}, got "
                        f"{type(compressed_page_sizes).__name__}")
    compressed_page_sizes = dict(compressed_page_sizes or {})
    for r, p in compressed_page_sizes.items():
        check_int(f"compressed ratio {r!r}", r, lo=1)
        check_int(f"compressed_page_sizes[{r}]", p, lo=1)
    if isinstance(requests, (RequestSpec, str, bytes, _MappingABC)) or \
            not isinstance(requests, _Iterable):
        raise TypeError(f"requests: expected a sequence of RequestSpec, got "
                        f"{type(requests).__name__}")
    reqs = list(requests)
    for i, rq in enumerate(reqs):
        if not isinstance(rq, RequestSpec):
            raise TypeError(f"requests[{i}]: expected a RequestSpec, got {type(rq).__name__}")
        check_int(f"requests[{i}].query_len", rq.query_len, lo=0)
        check_int(f"requests[{i}].prefix_len", rq.prefix_len, lo=0)
        if compressed_page_sizes and not isinstance(rq.compressed_block_tables, _MappingABC):
            raise TypeError(f"requests[{i}].compressed_block_tables: expected a mapping "
                            f"{{ratio: block ids}}, got {type(rq.compressed_block_tables).__name__}")

    is_decode = [rq.query_len <= decode_threshold for rq in reqs]
    num_decodes = 0
    while num_decodes < len(reqs) and is_decode[num_decodes]:
        num_decodes += 1
    if any(is_decode[num_decodes:]):
        first = num_decodes + is_decode[num_decodes:].index(True)
        raise ValueError(
            f"requests[{first}]: a decode request (query_len <= {decode_threshold}) after a "
            "prefill request; order the batch decodes first (as vLLM's reordered batch)"
        )
    num_prefills = len(reqs) - num_decodes
    if num_padding_tokens and num_prefills:
        raise ValueError("num_padding_tokens: padding is only supported in pure-decode steps")

    qlens = [rq.query_len for rq in reqs]
    seq = [rq.seq_len for rq in reqs]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    n_real = qsl[-1]
    num_decode_tokens = qsl[num_decodes] + num_padding_tokens
    T = n_real + num_padding_tokens
    W = window_size

    swa_tables = [_as_list(f"requests[{i}].swa_block_table", rq.swa_block_table)
                  for i, rq in enumerate(reqs)]
    swa_max_block = -1
    for i, (tb, s) in enumerate(zip(swa_tables, seq)):
        need = cdiv(s, swa_page_size)
        if len(tb) < need:
            raise ValueError(f"requests[{i}].swa_block_table: {len(tb)} blocks cannot hold "
                             f"{s} positions at page size {swa_page_size} (need {need})")
        swa_max_block = max(swa_max_block, _check_blocks(
            f"requests[{i}].swa_block_table", tb, need, f"positions 0..{s - 1}"))

    positions, tok_req, swa_slots = [], [], []
    for b, rq in enumerate(reqs):
        for i in range(rq.query_len):
            pos = rq.prefix_len + i
            positions.append(pos)
            tok_req.append(b)
            swa_slots.append(swa_tables[b][pos // swa_page_size] * swa_page_size
                             + pos % swa_page_size)
    positions += [0] * num_padding_tokens
    tok_req += [0] * num_padding_tokens
    swa_slots += [-1] * num_padding_tokens
    valid = [True] * n_real + [False] * num_padding_tokens

    # decode window indices
    Td = num_decode_tokens
    dec_idx = torch.full((Td, W), -1, dtype=torch.int32)
    dec_len = torch.zeros(Td, dtype=torch.int32)
    for t in range(qsl[num_decodes]):
        b, pos = tok_req[t], positions[t]
        lo = max(pos - W + 1, 0)
        ps = torch.arange(lo, pos + 1)
        blocks = torch.as_tensor(swa_tables[b], dtype=torch.int64)[ps // swa_page_size]
        dec_idx[t, : ps.numel()] = (blocks * swa_page_size + ps % swa_page_size).to(torch.int32)
        dec_len[t] = ps.numel()

    gather = [qlens[b] + min(reqs[b].prefix_len, W - 1) for b in range(num_decodes, len(reqs))]

    compressed: Dict[int, CompressedMetadata] = {}
    for r, cpage in compressed_page_sizes.items():
        tables = []
        max_block = -1
        for i, rq in enumerate(reqs):
            if r not in rq.compressed_block_tables:
                raise ValueError(f"requests[{i}].compressed_block_tables: no table for ratio {r}")
            tb = _as_list(f"requests[{i}].compressed_block_tables[{r}]",
                          rq.compressed_block_tables[r])
            need = cdiv(rq.seq_len // r, cpage)
            if len(tb) < need:
                raise ValueError(f"requests[{i}].compressed_block_tables[{r}]: {len(tb)} blocks "
                                 f"cannot hold {rq.seq_len // r} entries at page size {cpage}")
            max_block = max(max_block, _check_blocks(
                f"requests[{i}].compressed_block_tables[{r}]", tb, need,
                f"entries 0..{rq.seq_len // r - 1}"))
            tables.append(tb)
        slots = []
        for t in range(n_real):
            b, pos = tok_req[t], positions[t]
            if (pos + 1) % r == 0:
                e = pos // r
                slots.append(tables[b][e // cpage] * cpage + e % cpage)
            else:
                slots.append(-1)
        slots += [-1] * num_padding_tokens
        compressed[r] = CompressedMetadata(
            ratio=r, page_size=cpage, block_table=_table(tables, dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_entries_cpu=[s // r for s in seq], max_block_id=max_block,
        )

    return StepMetadata(
        num_reqs=len(reqs),
        num_decodes=num_decodes,
        num_prefills=num_prefills,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=n_real - qsl[num_decodes],
        num_tokens=T,
        window_size=W,
        swa_page_size=swa_page_size,
        max_position=max(positions) if positions else -1,
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        token_to_req=torch.tensor(tok_req, dtype=torch.int32, device=dev),
        is_valid_token=torch.tensor(valid, dtype=torch.bool, device=dev),
        swa_block_table=_table(swa_tables, dev),
        swa_slot_mapping=torch.tensor(swa_slots, dtype=torch.int64, device=dev),
        decode_swa_indices=dec_idx.to(dev),
        decode_swa_lens=dec_len.to(dev),
        prefill_seq_lens=torch.tensor(seq[num_decodes:], dtype=torch.int32, device=dev),
        prefill_gather_lens=torch.tensor(gather, dtype=torch.int32, device=dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        prefill_gather_lens_cpu=gather,
        compressed=compressed,
        prefill_chunk_size=prefill_chunk_size,
        max_workspace_rows=max_workspace_rows,
        swa_max_block_id=swa_max_block,
    )
