"""Synthetic serving steps for the attention layer: requests with their history, block tables
and per-step inputs (for tests and benchmarks).

A :class:`Scenario` hands out random blocks to requests as they appear and, for each step
``[(request, new tokens), ...]`` (decodes first, as vLLM orders a batch), builds the step's
:class:`~dsv41_triton.layers.metadata.StepMetadata` with fresh random inputs:
``hidden [T, hidden]`` bf16, the compressor output ``compressed_kv [T, 512]`` bf16 and the
indexer's ``topk_indices [T, topk]`` int32 (local entry ids, ``-1`` padded, about one in five
picks dropped to ``-1``). Everything is drawn from one generator seeded by ``seed``: two
scenarios built with the same arguments produce identical steps (what every TP rank relies on).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch

from .config import DeepseekV41AttentionConfig
from .metadata import RequestSpec, StepMetadata, build_step_metadata


class ScenarioStep(NamedTuple):
    """One step's inputs; ``owners[i] = (request, position)`` of real token ``i`` (padding
    tokens come after them and have no owner)."""

    metadata: StepMetadata
    hidden: torch.Tensor  # [T, hidden] bf16
    compressed_kv: torch.Tensor  # [T, 512] bf16
    topk_indices: torch.Tensor  # [T, topk] int32
    owners: List[Tuple[str, int]]


class Scenario:
    """Requests with their history (``req[name]``: blocks, and the per-step ``hidden``, ``ckv``,
    ``topk`` tensors on the CPU), block tables and per-step inputs for one layer.

    Args:
        cfg, layer_id: the layer (its compress ratio ``r`` shapes the top-k rows).
        seed: seeds every random draw (blocks, inputs, top-k picks).
        num_blocks: blocks in each cache (window and compressed); ``blocks_per_req`` of them
            are given to each request when it first appears.
        page, cpage: page sizes of the window and compressed caches.
        device: where the metadata and step tensors are put.
    """

    def __init__(self, cfg: DeepseekV41AttentionConfig, layer_id: int, seed: int = 0,
                 num_blocks: int = 64, page: int = 4, cpage: int = 4, blocks_per_req: int = 6,
                 device="cpu", max_len: int = 64):
        self.cfg, self.layer_id = cfg, layer_id
        self.page, self.cpage, self.bpr, self.device = page, cpage, blocks_per_req, device
        self.max_len = max_len
        self.r = cfg.compress_ratio(layer_id)
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.cpool = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.req: Dict[str, dict] = {}

    def _new(self, name: str) -> None:
        if len(self.pool) < self.bpr:
            raise ValueError(f"num_blocks: too few blocks for request {name!r} "
                             f"({self.bpr} per request)")
        blocks = [self.pool.pop() for _ in range(self.bpr)]
        cblocks = [self.cpool.pop() for _ in range(self.bpr)]
        self.req[name] = dict(blocks=blocks, cblocks=cblocks, hidden=[], ckv=[], topk=[])

    def topk_rows(self, first_pos: int, n: int) -> torch.Tensor:
        """``[n, topk]`` int32 for tokens at positions ``first_pos ..``: the token at ``pos``
        picks ``min((pos + 1) // r, topk)`` distinct entries among the completed ones, in random
        order, about 20% of them dropped to ``-1``; the other columns ``-1`` (all ``-1`` for a
        window-only layer)."""
        K = self.cfg.index_topk
        out = torch.full((n, K), -1, dtype=torch.int32)
        if self.r == 0 or n == 0:
            return out
        for a in range(0, n, 256):  # row chunks bound the [rows, entries] scratch
            b = min(n, a + 256)
            pos = torch.arange(first_pos + a, first_pos + b)
            avail = torch.div(pos + 1, self.r, rounding_mode="floor")
            width = max(int(avail[-1]), K)
            keys = torch.rand(b - a, width, generator=self.gen)
            keys[torch.arange(width)[None, :] >= avail[:, None]] = 2.0  # not completed yet
            picks = keys.topk(K, dim=1, largest=False).indices  # random order, distinct
            keep = torch.arange(K)[None, :] < avail.clamp(max=K)[:, None]
            keep &= torch.rand(b - a, K, generator=self.gen) > 0.2
            out[a:b] = torch.where(keep, picks, torch.full_like(picks, -1)).to(torch.int32)
        return out

    def step(self, plan: Sequence[Tuple[str, int]], padding: int = 0,
             chunk_size: int = 4) -> ScenarioStep:
        """plan: ``[(request, new tokens)]``, decodes (``<= 1`` token) first; ``padding``
        invalid tokens appended (pure-decode steps only); ``chunk_size`` prefill requests per
        workspace chunk."""
        specs, hid, ckv, tk, owners = [], [], [], [], []
        H = self.cfg.hidden_size
        for name, n in plan:
            if name not in self.req:
                self._new(name)
            st = self.req[name]
            prefix = sum(h.shape[0] for h in st["hidden"])
            h = torch.randn(n, H, generator=self.gen).bfloat16()
            c = torch.randn(n, 512, generator=self.gen).bfloat16()
            t = self.topk_rows(prefix, n)
            for lst, v in ((st["hidden"], h), (st["ckv"], c), (st["topk"], t)):
                lst.append(v)
            hid.append(h)
            ckv.append(c)
            tk.append(t)
            owners += [(name, prefix + i) for i in range(n)]
            specs.append(RequestSpec(n, prefix, st["blocks"],
                                     {self.r: st["cblocks"]} if self.r else {}))
        md = build_step_metadata(specs, window_size=self.cfg.sliding_window,
                                 swa_page_size=self.page,
                                 compressed_page_sizes={self.r: self.cpage} if self.r else None,
                                 num_padding_tokens=padding, prefill_chunk_size=chunk_size,
                                 device=self.device)
        hid.append(torch.randn(padding, H, generator=self.gen).bfloat16())
        ckv.append(torch.randn(padding, 512, generator=self.gen).bfloat16())
        tk.append(torch.full((padding, self.cfg.index_topk), -1, dtype=torch.int32))
        d = self.device
        return ScenarioStep(md, torch.cat(hid).to(d), torch.cat(ckv).to(d), torch.cat(tk).to(d),
                            owners)


__all__ = ["Scenario", "ScenarioStep"]
