"""Case families: how to build inputs, call an implementation, check it, and count its work.

Every family calls implementations with the SPEC signatures (§5 ops, §6 attention), so any
callable with that signature can join the comparison. For each case the harness:

1. ``state = family.build(case, device, seed)`` — random inputs (never zeros); caches hold valid
   records at every slot that is read, random bytes elsewhere;
2. ``call = family.fresh(state)`` — a private copy of whatever the call writes, poisoned;
3. ``outputs = family.invoke(fn, call)``;
4. ``family.check(state, call, outputs, ref)`` against ``ref = family.reference(state, ...)``:
   float64 oracle for attention (relative Frobenius error of ``out``, max abs ``lse`` error),
   exact reference for the ops (bit-equality);
5. ``family.work(case, state)`` — FLOPs and unique bytes moved, for TFLOP/s and GB/s.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .._utils import HEAD_DIM, cdiv, round_up
from ..testing import max_abs_err, poison_, rel_err
from .cases import Case

# SPEC §7
OUT_REL_TOL = 1e-2
LSE_ABS_TOL = 1e-3

#: where each family's reference lives (module, attribute); resolved lazily
REFERENCES: Dict[str, Tuple[str, str]] = {
    "decode": ("dsv41_triton.attention.ref", "sparse_mla_decode_ref"),
    "prefill": ("dsv41_triton.attention.ref", "sparse_mla_prefill_ref"),
    "insert": ("dsv41_triton.ops.kv_cache_ref", "quantize_and_insert_k_cache_ref"),
    "gather": ("dsv41_triton.ops.kv_cache_ref", "dequantize_and_gather_k_cache_ref"),
    "combine_indices": ("dsv41_triton.ops.indices_ref", "combine_topk_swa_indices_ref"),
    "global_topk": ("dsv41_triton.ops.indices_ref", "compute_global_topk_indices_and_lens_ref"),
    "index_logits": ("dsv41_triton.ops.indexer_ref", "index_logits_ref"),
    "index_topk": ("dsv41_triton.ops.indexer_ref", "index_topk_ref"),
}


def resolve(module: str, attr: str) -> Optional[Callable]:
    """``module.attr`` or None when the module or the attribute does not exist (yet)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(mod, attr, None)


def reference_fn(family: str) -> Optional[Callable]:
    return resolve(*REFERENCES[family])


@dataclass
class Check:
    """Error figures of one call against the reference."""

    passed: Optional[bool]  # None: no reference available
    out_rel_err: float = float("nan")
    lse_max_err: float = float("nan")
    bit_exact: Optional[bool] = None
    ref_tokens: Optional[int] = None
    note: str = ""


def _gen(device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _randn(shape, g, device, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def _randperm(n, g, device):
    return torch.randperm(n, generator=g, device=device)


def _sample_rows(n: int, k: int, max_tokens: Optional[int], device) -> torch.Tensor:
    """Evenly spaced token rows (first and last included), at most ``max_tokens``."""
    if max_tokens is None or n <= max_tokens:
        return torch.arange(n, device=device)
    idx = torch.linspace(0, n - 1, max_tokens).round().long().unique()
    return idx.to(device)


def fill_records(cache: torch.Tensor, slots: torch.Tensor, g, chunk: int = 65536) -> None:
    """Write valid records of random bf16 rows at ``slots`` (int, ``>= 0``) of ``cache``."""
    from ..ops.records import check_k_cache, encode_records_ref, record_views

    fmt, c3 = check_k_cache("cache", cache)
    page = c3.shape[1]
    dv, sv = record_views(c3, fmt)
    slots = slots.long().flatten()
    for s in range(0, slots.numel(), chunk):
        sl = slots[s : s + chunk]
        k = _randn((sl.numel(), HEAD_DIM), g, cache.device)
        data, scales = encode_records_ref(k, fmt)
        dv[sl // page, sl % page] = data
        sv[sl // page, sl % page] = scales


def _paged_slots(local: torch.Tensor, block_table_row: torch.Tensor, page: int) -> torch.Tensor:
    """Local positions -> slot ids through one request's block table row."""
    local = local.long()
    return block_table_row.long()[local // page] * page + local % page


class Family:
    """Base class; see the module docstring."""

    name = ""
    kind = "op"  # "attention" | "op"

    def build(self, case: Case, device, seed: int) -> Dict[str, Any]:
        raise NotImplementedError

    def fresh(self, state: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def invoke(self, fn: Callable, call: Dict[str, Any]):
        raise NotImplementedError

    def reference(self, state: Dict[str, Any], max_ref_tokens: Optional[int] = None):
        raise NotImplementedError

    def check(self, state, call, outputs, ref) -> Check:
        raise NotImplementedError

    def work(self, case: Case, state: Dict[str, Any]) -> Tuple[float, float]:
        """(FLOPs, unique bytes read + written) of one call."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
def _attn_check(out, lse, ref_out, ref_lse, rows, note="") -> Check:
    out = out[rows]
    lse = lse[rows] if lse is not None else None
    e_out = rel_err(out, ref_out)
    e_lse = max_abs_err(lse.reshape(ref_lse.shape), ref_lse) if lse is not None else float("inf")
    ok = bool(e_out <= OUT_REL_TOL and e_lse <= LSE_ABS_TOL)
    why = [note] if note else []
    if not ok:
        nan = int(torch.isnan(out.float()).sum())
        if nan:
            why.append(f"{nan} NaN in out (unwritten or overflow)")
        if not e_out <= OUT_REL_TOL:
            why.append(f"out rel err {e_out:.2g} > {OUT_REL_TOL:g}")
        if not e_lse <= LSE_ABS_TOL:
            why.append(f"lse err {e_lse:.2g} > {LSE_ABS_TOL:g}")
    return Check(ok, e_out, e_lse, None, int(rows.numel()), "; ".join(why))


def _unique_slots(indices: torch.Tensor, lens: torch.Tensor) -> int:
    """Distinct slot ids ``>= 0`` among the first ``lens[t]`` columns of each row."""
    cols = torch.arange(indices.shape[1], device=indices.device)
    live = (cols[None, :] < lens.long()[:, None]) & (indices >= 0)
    return int(torch.unique(indices[live]).numel())


class DecodeFamily(Family):
    """``sparse_mla_decode`` over a window cache (+ a compressed cache on compressed layers).

    Requests hold ``tokens / requests`` decode tokens each. Window keys are the ``W`` positions
    ending at the token (through a per-request block table starting at a random page offset);
    compressed keys are ``topk`` distinct random entries out of ``2 * topk`` of the request's
    compressed cache, in random order (as an indexer returns them)."""

    name = "decode"
    kind = "attention"

    def build(self, case, device, seed):
        from ..ops.records import allocate_k_cache

        g = _gen(device, seed)
        T, H, W, K, P = case.tokens, case.heads, case.window, case.topk, case.page
        B = max(1, min(case.requests, T))
        req = torch.arange(T, device=device) * B // T  # token -> request (contiguous runs)
        q_per = torch.bincount(req, minlength=B)
        first = torch.cumsum(q_per, 0) - q_per
        i_in_req = torch.arange(T, device=device) - first[req]
        # window cache: request b needs W + q_b - 1 positions (local 0..), offset o_b in page
        span = W + int(q_per.max()) - 1
        nblk = cdiv(span + P, P)
        swa_cache = allocate_k_cache(B * nblk, P, case.swa_record, device)
        swa_bt = _randperm(B * nblk, g, device).view(B, nblk).to(torch.int32)
        o = torch.randint(0, P, (B,), generator=g, device=device)
        j = i_in_req[:, None] + torch.arange(W, device=device)[None, :] + o[req][:, None]
        swa_idx = (swa_bt.long()[req[:, None], j // P] * P + j % P).to(torch.int32)
        swa_lens = torch.full((T,), W, dtype=torch.int32, device=device)
        fill_records(swa_cache, torch.unique(swa_idx), g)
        st = dict(case=case, swa_cache=swa_cache, swa_indices=swa_idx, swa_lens=swa_lens,
                  extra_cache=None, extra_indices=None, extra_lens=None)
        if case.extra_record is not None and case.ratio > 0:
            n_comp = 2 * K
            ncb = cdiv(n_comp, P)
            extra_cache = allocate_k_cache(B * ncb, P, case.extra_record, device)
            ebt = _randperm(B * ncb, g, device).view(B, ncb).to(torch.int32)
            loc = torch.rand(T, n_comp, generator=g, device=device).argsort(dim=1)[:, :K]
            eidx = (ebt.long()[req[:, None], loc // P] * P + loc % P).to(torch.int32)
            fill_records(extra_cache, torch.unique(eidx), g)
            st.update(extra_cache=extra_cache, extra_indices=eidx,
                      extra_lens=torch.full((T,), K, dtype=torch.int32, device=device))
        st["q"] = _randn((T, H, HEAD_DIM), g, device)
        st["attn_sink"] = torch.randn(H, generator=g, device=device).float()
        return st

    def fresh(self, state):
        c = dict(state)
        c["out"] = poison_(torch.empty_like(state["q"]))
        return c

    def invoke(self, fn, call):
        return fn(call["q"], call["swa_cache"], call["swa_indices"], call["swa_lens"],
                  call["extra_cache"], call["extra_indices"], call["extra_lens"],
                  attn_sink=call["attn_sink"], softmax_scale=None, out=call["out"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        if ref is None:
            return None
        rows = _sample_rows(state["q"].shape[0], 0, max_ref_tokens, state["q"].device)

        def sub(x):
            return None if x is None else x[rows]

        out, lse = ref(state["q"][rows], state["swa_cache"], sub(state["swa_indices"]),
                       sub(state["swa_lens"]), state["extra_cache"], sub(state["extra_indices"]),
                       sub(state["extra_lens"]), attn_sink=state["attn_sink"], softmax_scale=None)
        return rows, out, lse

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        rows, rout, rlse = ref
        out, lse = outputs
        note = "" if rows.numel() == state["q"].shape[0] else f"checked {rows.numel()} tokens"
        return _attn_check(out, lse, rout, rlse, rows, note)

    def work(self, case, state):
        """FLOPs count every (token, key) pair; bytes count each record once, however many
        tokens of a request read it (decode tokens of one request share window keys), plus
        q, out and lse."""
        T, H = case.tokens, case.heads
        n_swa = int(state["swa_lens"].long().sum())
        n_ext = int(state["extra_lens"].long().sum()) if state["extra_lens"] is not None else 0
        flops = 4.0 * H * (n_swa + n_ext) * HEAD_DIM
        u_swa = _unique_slots(state["swa_indices"], state["swa_lens"])
        u_ext = (_unique_slots(state["extra_indices"], state["extra_lens"])
                 if state["extra_lens"] is not None else 0)
        rec_e = case.extra_record or 0
        byts = u_swa * case.swa_record + u_ext * rec_e + T * H * (2 * HEAD_DIM * 2 + 4)
        return flops, float(byts)


class PrefillFamily(Family):
    """``sparse_mla_prefill`` for one request's chunk of ``tokens`` queries over a gathered bf16
    workspace laid out as combine_topk_swa_indices makes it: ``N = 2*topk`` compressed rows, then
    the chunk's window rows. Index rows are ``round_up(keys, 128)`` wide, ``-1`` padded."""

    name = "prefill"
    kind = "attention"

    def build(self, case, device, seed):
        g = _gen(device, seed)
        T, H, W, K = case.tokens, case.heads, case.window, case.topk
        N = 2 * K if case.ratio > 0 else 0
        G = T + W - 1  # window rows of the chunk: the W-1 positions before it + its own
        S = N + G
        width = round_up(case.keys, 128)
        idx = torch.full((T, width), -1, dtype=torch.int32, device=device)
        kk = 0
        if case.ratio > 0:
            loc = torch.rand(T, N, generator=g, device=device).argsort(dim=1)[:, :K]
            idx[:, :K] = loc.to(torch.int32)
            kk = K
        win = N + torch.arange(T, device=device)[:, None] + torch.arange(W, device=device)[None, :]
        idx[:, kk : kk + W] = win.to(torch.int32)
        lens = torch.full((T,), kk + W, dtype=torch.int32, device=device)
        return dict(case=case, q=_randn((T, H, HEAD_DIM), g, device),
                    kv=_randn((S, HEAD_DIM), g, device), indices=idx, lens=lens,
                    attn_sink=torch.randn(H, generator=g, device=device).float())

    def fresh(self, state):
        c = dict(state)
        c["out"] = poison_(torch.empty_like(state["q"]))
        return c

    def invoke(self, fn, call):
        return fn(call["q"], call["kv"], call["indices"], call["lens"],
                  attn_sink=call["attn_sink"], softmax_scale=None, out=call["out"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        if ref is None:
            return None
        rows = _sample_rows(state["q"].shape[0], 0, max_ref_tokens, state["q"].device)
        out, lse = ref(state["q"][rows], state["kv"], state["indices"][rows], state["lens"][rows],
                       attn_sink=state["attn_sink"], softmax_scale=None)
        return rows, out, lse

    check = DecodeFamily.check

    def work(self, case, state):
        T, H = case.tokens, case.heads
        n = int(state["lens"].long().sum())
        flops = 4.0 * H * n * HEAD_DIM
        idx = state["indices"]
        uniq = int(torch.unique(idx[idx >= 0]).numel())
        byts = uniq * HEAD_DIM * 2 + T * H * (2 * HEAD_DIM * 2 + 4) + idx.numel() * 4
        return flops, float(byts)


# ---------------------------------------------------------------------------------------------
# the fused ("mega") contract
# ---------------------------------------------------------------------------------------------
class _Fused:
    """The fused contract (SPEC §6) around a decode/prefill family: ``q`` in the case's layout
    and NOT RoPE'd, ``positions`` + an fp32 ``cos_sin_cache``, an optional per-head Q RMSNorm,
    and the MXFP8 ``(data, scale)`` pair out.

    Check: the output is dequantized and compared with the float64 oracle (Q norm + RoPE as
    the composition does, oracle attention, inverse RoPE in float64, regrouped in the layout).
    MXFP8 alone costs some error, so the bound is the SPEC attention tolerance on top of the
    error of the oracle's own MXFP8 quantization: ``err <= err_q + 1e-2``; ``lse`` as usual.
    The fraction of UE8M0 scale bytes that differ from the quantized oracle is in the note."""

    base: Family
    MAX_POS = 1 << 16
    Q_NORM_EPS = 1e-6

    def build(self, case, device, seed):
        from ..ops.rope_ref import make_cos_sin_cache

        st = self.base.build(case, device, seed)
        g = _gen(device, seed + 1)
        T = case.tokens
        st["positions"] = torch.randint(case.window, self.MAX_POS, (T,), generator=g,
                                        device=device).to(torch.int64)
        st["cos_sin_cache"] = make_cos_sin_cache(self.MAX_POS, device=device)
        st["q_norm_eps"] = self.Q_NORM_EPS if case.q_norm else None
        st["layout"] = case.layout
        return st

    def fresh(self, state):
        from ..ops.mxfp8 import alloc_mxfp8_output

        c = dict(state)
        T, H = state["q"].shape[0], state["q"].shape[1]
        data, scale = alloc_mxfp8_output(T, H // 8, state["q"].device)
        poison_(data)
        scale.as_strided((scale.untyped_storage().nbytes() // 4,), (1,), 0).fill_(-1)
        c.update(data=data, scale=scale)
        return c

    def _oracle(self, state, rows):
        """float64 ``[rows, G, 4096]`` reference output (before MXFP8) and its lse."""
        from ..backends._compose import q_head_rmsnorm, q_to_standard
        from ..ops.layouts import output_to_groups
        from ..ops.rope_ref import apply_rope_ref

        pos, cs = state["positions"][rows], state["cos_sin_cache"]
        qs = q_to_standard(state["q"][rows], state["layout"])
        if state["q_norm_eps"] is not None:
            qs = q_head_rmsnorm(qs, state["q_norm_eps"])
        q_roped = apply_rope_ref(qs, pos, cs)
        sub = dict(state, q=q_roped)
        for k in ("swa_indices", "swa_lens", "extra_indices", "extra_lens", "indices", "lens"):
            if sub.get(k) is not None:
                sub[k] = state[k][rows]
        o, lse = self._attend(sub)
        o = apply_rope_ref(o.double(), pos, cs, inverse=True, compute_dtype=torch.float64)
        return output_to_groups(o, state["layout"]), lse

    def reference(self, state, max_ref_tokens=None):
        if reference_fn(self.base.name) is None:
            return None
        from ..ops.mxfp8_ref import mxfp8_dequantize_ref, mxfp8_quantize_ref, unpack_ue8m0_words

        rows = _sample_rows(state["q"].shape[0], 0, max_ref_tokens, state["q"].device)
        ref, lse = self._oracle(state, rows)
        d, sc = mxfp8_quantize_ref(ref)
        e_q = rel_err(mxfp8_dequantize_ref(d, sc), ref)
        return rows, ref, lse, e_q, unpack_ue8m0_words(sc)

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        from ..ops.mxfp8_ref import mxfp8_dequantize_ref, unpack_ue8m0_words

        rows, rout, rlse, e_q, rbytes = ref
        data, scale, lse = outputs
        deq = mxfp8_dequantize_ref(data[rows], scale[rows])
        e_out = rel_err(deq, rout)
        e_lse = max_abs_err(lse[rows].reshape(rlse.shape), rlse)
        tol = e_q + OUT_REL_TOL
        ok = bool(e_out <= tol and e_lse <= LSE_ABS_TOL)
        sb = unpack_ue8m0_words(scale[rows])
        why = [f"MXFP8 alone: {e_q:.2g}; scale bytes differing: "
               f"{float((sb != rbytes).float().mean()):.2%}"]
        if rows.numel() != state["q"].shape[0]:
            why.insert(0, f"checked {rows.numel()} tokens")
        if not ok:
            nan = int(torch.isnan(deq).sum())
            if nan:
                why.append(f"{nan} NaN in the dequantized output")
            if not e_out <= tol:
                why.append(f"out rel err {e_out:.2g} > {tol:.2g}")
            if not e_lse <= LSE_ABS_TOL:
                why.append(f"lse err {e_lse:.2g} > {LSE_ABS_TOL:g}")
        return Check(ok, e_out, e_lse, None, int(rows.numel()), "; ".join(why))

    def work(self, case, state):
        flops, nbytes = self.base.work(case, state)
        T, H = case.tokens, case.heads
        # bf16 out (2 B/elem) replaced by e4m3 data (1 B/elem) + one UE8M0 byte per 32
        return flops, nbytes - T * H * HEAD_DIM * 2 + T * H * (HEAD_DIM + HEAD_DIM // 32)


class FusedDecodeFamily(_Fused, DecodeFamily):
    name = "decode_fused"
    base = DecodeFamily()

    def invoke(self, fn, call):
        return fn(call["q"], call["positions"], call["cos_sin_cache"], call["swa_cache"],
                  call["swa_indices"], call["swa_lens"], call["extra_cache"],
                  call["extra_indices"], call["extra_lens"], attn_sink=call["attn_sink"],
                  softmax_scale=None, q_norm_eps=call["q_norm_eps"], layout=call["layout"],
                  data=call["data"], scale=call["scale"])

    def _attend(self, s):
        return reference_fn("decode")(
            s["q"], s["swa_cache"], s["swa_indices"], s["swa_lens"], s["extra_cache"],
            s["extra_indices"], s["extra_lens"], attn_sink=s["attn_sink"], softmax_scale=None)


class FusedPrefillFamily(_Fused, PrefillFamily):
    name = "prefill_fused"
    base = PrefillFamily()

    def invoke(self, fn, call):
        return fn(call["q"], call["positions"], call["cos_sin_cache"], call["kv"],
                  call["indices"], call["lens"], attn_sink=call["attn_sink"], softmax_scale=None,
                  q_norm_eps=call["q_norm_eps"], layout=call["layout"], data=call["data"],
                  scale=call["scale"])

    def _attend(self, s):
        return reference_fn("prefill")(s["q"], s["kv"], s["indices"], s["lens"],
                                       attn_sink=s["attn_sink"], softmax_scale=None)


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------
def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        # compare bit patterns so that NaN poison left in both compares equal
        iv = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(iv), b.contiguous().view(iv)))
    return bool(torch.equal(a, b))


def _flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's blocks, padding included (a 1-D uint8 view)."""
    avail = cache.untyped_storage().nbytes() - cache.storage_offset()
    n = min(cache.shape[0] * cache.stride(0), avail)
    return cache.as_strided((n,), (1,), cache.storage_offset())


def _clone_cache(src: torch.Tensor) -> torch.Tensor:
    """A copy of a paged cache with the same strides and every byte (padding included)."""
    flat = _flat_bytes(src).clone()
    return flat.as_strided(src.shape, src.stride(), 0)


class InsertFamily(Family):
    """``quantize_and_insert_k_cache``: ``tokens`` rows to distinct random slots of a cache with
    twice as many slots. Checked byte for byte over the whole cache (padding included); for the
    288-byte record a differing e2m1 code passes only where the input was an exact tie."""

    name = "insert"

    def build(self, case, device, seed):
        from ..ops.records import allocate_k_cache

        g = _gen(device, seed)
        T, P = case.tokens, case.page
        nb = cdiv(2 * T, P) + 1
        cache = allocate_k_cache(nb, P, case.swa_record, device)
        gen_bytes = torch.randint(0, 256, (_flat_bytes(cache).numel(),), generator=g,
                                  device=device, dtype=torch.uint8)
        _flat_bytes(cache).copy_(gen_bytes)
        slots = _randperm(nb * P, g, device)[:T].to(torch.int64)
        return dict(case=case, k=_randn((T, HEAD_DIM), g, device), cache=cache, slots=slots)

    def fresh(self, state):
        c = dict(state)
        c["cache"] = _clone_cache(state["cache"])
        return c

    def invoke(self, fn, call):
        fn(call["k"], call["cache"], call["slots"])
        return call["cache"]

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        if ref is None:
            return None
        c = self.fresh(state)
        ref(c["k"], c["cache"], c["slots"])
        return c["cache"]

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        a, b = _flat_bytes(outputs), _flat_bytes(ref)
        if _bytes_equal(a, b):
            return Check(True, 0.0, float("nan"), True)
        if state["case"].swa_record == 288:
            ok, note = _nvfp4_ties_only(state, outputs, ref)
            return Check(ok, _mismatch_frac(a, b), float("nan"), False, note=note)
        return Check(False, _mismatch_frac(a, b), float("nan"), False,
                     note=f"{int((a != b).sum())} bytes differ")

    def work(self, case, state):
        return 0.0, float(case.tokens * (HEAD_DIM * 2 + case.swa_record + 8))


def _mismatch_frac(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of differing bytes (reported in ``out_rel_err`` for the exact ops)."""
    return float((a != b).float().mean()) if a.numel() else 0.0


def _nvfp4_ties_only(state, got_cache, ref_cache) -> Tuple[bool, str]:
    """Whether every difference between two NVFP4 caches is an e2m1 rounding tie."""
    from ..ops.records import NVFP4, e2m1_codes_to_float, record_views

    page = got_cache.shape[1]
    s = state["slots"]
    blk, off = s // page, s % page
    dg, sg = record_views(got_cache, NVFP4)
    dr, sr = record_views(ref_cache, NVFP4)
    # bytes outside the written records must be untouched
    if not torch.equal(sg[blk, off], sr[blk, off]):
        return False, "nvfp4 scale bytes differ"
    mask_cache = torch.zeros_like(_flat_bytes(got_cache)).as_strided(
        got_cache.shape, got_cache.stride(), 0)
    md, ms = record_views(mask_cache, NVFP4)
    md[blk, off] = 1
    ms[blk, off] = 1
    outside = _flat_bytes(mask_cache) == 0
    if not torch.equal(_flat_bytes(got_cache)[outside], _flat_bytes(ref_cache)[outside]):
        return False, "bytes outside the written records differ"
    cg, cr = dg[blk, off], dr[blk, off]

    def codes(d):
        return torch.stack([d & 15, d >> 4], -1).flatten(-2)

    kg, kr = codes(cg), codes(cr)
    diff = kg != kr
    if not diff.any():
        return True, ""
    scale = sr[blk, off].contiguous().view(torch.float8_e4m3fn).float()  # [T, 32]
    y = state["k"].float().view(-1, 32, 16) / scale.unsqueeze(-1)
    y = y.flatten(1)
    vg, vr = e2m1_codes_to_float(kg), e2m1_codes_to_float(kr)
    tie = (y - vg).abs() == (y - vr).abs()
    if bool(tie[diff].all()):
        return True, f"{int(diff.sum())} e2m1 ties rounded the other way (allowed)"
    return False, f"{int((diff & ~tie).sum())} e2m1 codes differ (not ties)"


class GatherFamily(Family):
    """``dequantize_and_gather_k_cache``: ``requests`` requests, the last ``tokens`` positions of
    each (sequence lengths ``tokens + [0, page)``) into rows ``offset ..`` of a poisoned
    workspace. Checked bit for bit over the whole workspace."""

    name = "gather"
    OFFSET = 8

    def build(self, case, device, seed):
        from ..ops.records import allocate_k_cache

        g = _gen(device, seed)
        B, G, P = case.requests, case.tokens, case.page
        seq = G + torch.randint(0, P, (B,), generator=g, device=device)
        nblk = cdiv(int(seq.max()), P)
        cache = allocate_k_cache(B * nblk, P, case.swa_record, device)
        bt = _randperm(B * nblk, g, device).view(B, nblk).to(torch.int32)
        pos = (seq - G)[:, None] + torch.arange(G, device=device)[None, :]
        slots = bt.long().gather(1, pos // P) * P + pos % P
        fill_records(cache, slots, g)
        M = self.OFFSET + G + 3
        out = torch.empty(B, M, HEAD_DIM, dtype=torch.bfloat16, device=device)
        return dict(case=case, cache=cache, seq_lens=seq.to(torch.int32),
                    gather_lens=torch.full((B,), G, dtype=torch.int32, device=device),
                    block_table=bt, out_template=out)

    def fresh(self, state):
        c = dict(state)
        c["out"] = poison_(torch.empty_like(state["out_template"]))
        return c

    def invoke(self, fn, call):
        fn(call["out"], call["cache"], call["seq_lens"], call["gather_lens"],
           call["block_table"], call["case"].page, self.OFFSET)
        return call["out"]

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        if ref is None:
            return None
        c = self.fresh(state)
        return self.invoke(ref, c)

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        if _bytes_equal(outputs, ref):
            return Check(True, 0.0, float("nan"), True)
        a = outputs.contiguous().view(torch.int16)
        b = ref.contiguous().view(torch.int16)
        return Check(False, _mismatch_frac(a, b), float("nan"), False,
                     note=f"{int((a != b).sum())} of {a.numel()} elements differ")

    def work(self, case, state):
        n = case.requests * case.tokens
        return 0.0, float(n * (case.swa_record + HEAD_DIM * 2))


class CombineIndicesFamily(Family):
    """``combine_topk_swa_indices``: a prefill step of ``requests`` requests sharing ``tokens``
    query tokens, each request's chunk ending its sequence (context ``4 * topk * r`` plus a
    random tail); top-k local indices random in ``[-1, N + 8)`` (N = the request's compressed
    entries, so some are out of range)."""

    name = "combine_indices"

    def build(self, case, device, seed):
        g = _gen(device, seed)
        T, B, W, K = case.tokens, max(1, min(case.requests, case.tokens)), case.window, case.topk
        r = case.ratio
        qlen = torch.full((B,), T // B, dtype=torch.int64, device=device)
        qlen[: T % B] += 1
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=device)
        qsl[1:] = torch.cumsum(qlen, 0).to(torch.int32)
        ctx = 4 * K * max(r, 1) + torch.randint(0, 64, (B,), generator=g, device=device)
        seq = ctx + qlen
        gather = torch.minimum(seq, qlen + W - 1)
        N = int(4 * K + 64)  # compressed rows reserved per request
        M = N + int(gather.max())
        tk = torch.randint(-1, N + 8, (T, K), generator=g, device=device).to(torch.int32)
        return dict(case=case, topk_indices=tk, query_start_loc=qsl, seq_lens=seq.to(torch.int32),
                    gather_lens=gather.to(torch.int32), M=M, N=N)

    def fresh(self, state):
        return dict(state)

    def invoke(self, fn, call):
        c = call["case"]
        return fn(call["topk_indices"], call["query_start_loc"], call["seq_lens"],
                  call["gather_lens"], c.window, c.ratio, c.topk, call["M"], call["N"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        return None if ref is None else self.invoke(ref, state)

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        return _check_pair(outputs, ref)

    def work(self, case, state):
        width = round_up(case.topk + case.window, 128)
        return 0.0, float(case.tokens * (case.topk * 4 + width * 4 + 4))


class GlobalTopkFamily(Family):
    """``compute_global_topk_indices_and_lens``: ``tokens`` decode tokens of ``max(1, T/16)``
    requests; local indices in ``[-1, 2*topk + page)`` (some past the block table), one token
    in 8 invalid."""

    name = "global_topk"

    def build(self, case, device, seed):
        g = _gen(device, seed)
        T, K, P = case.tokens, case.topk, case.page
        B = max(1, T // 16)
        n_comp = 2 * K
        nblk = cdiv(n_comp, P)
        bt = _randperm(B * nblk + 3, g, device)[: B * nblk].view(B, nblk).to(torch.int32)
        tk = torch.randint(-1, n_comp + P, (T, K), generator=g, device=device).to(torch.int32)
        t2r = torch.randint(0, B, (T,), generator=g, device=device).to(torch.int32)
        valid = (torch.arange(T, device=device) % 8) != 5
        return dict(case=case, topk_indices=tk, token_to_req_indices=t2r, block_table=bt,
                    is_valid_token=valid)

    def fresh(self, state):
        return dict(state)

    def invoke(self, fn, call):
        return fn(call["topk_indices"], call["token_to_req_indices"], call["block_table"],
                  call["case"].page, call["is_valid_token"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        return None if ref is None else self.invoke(ref, state)

    check = CombineIndicesFamily.check

    def work(self, case, state):
        T, K = case.tokens, case.topk
        return 0.0, float(T * (K * 8 + 4 + 4 + 1))


def _check_pair(outputs, ref) -> Check:
    """Exact comparison of ``(indices, lens)`` pairs."""
    (ig, lg), (ir, lr) = outputs, ref
    ok_i = ig.shape == ir.shape and torch.equal(ig.long(), ir.long())
    ok_l = lg.shape == lr.shape and torch.equal(lg.long().flatten(), lr.long().flatten())
    if ok_i and ok_l:
        return Check(True, 0.0, float("nan"), True)
    if ig.shape != ir.shape:
        return Check(False, 1.0, float("nan"), False,
                     note=f"indices shape {tuple(ig.shape)} != {tuple(ir.shape)}")
    frac = _mismatch_frac(ig.long(), ir.long())
    what = ([] if ok_i else [f"{int((ig.long() != ir.long()).sum())} indices differ"]) + (
        [] if ok_l else ["lens differ"])
    return Check(False, frac, float("nan"), False, note="; ".join(what))


class IndexLogitsFamily(Family):
    """``index_logits``: ``tokens`` query tokens over ``entries`` FP8 index keys per request
    (``INDEX_DIM`` wide, random valid bytes, power-of-two scales). ``requests == tokens``: one
    decode token per request, every key visible; one request: the request's last ``tokens``
    positions (ratio 1, causal). Checked against the float64 oracle on at most 16 rows."""

    name = "index_logits"

    def build(self, case, device, seed):
        from ..ops.indexer_ref import INDEX_SCALE_BYTES
        from .cases import INDEX_DIM

        g = _gen(device, seed)
        T, H, N, P = case.tokens, case.heads, case.entries, case.page
        B = max(1, min(case.requests, T))
        nbr = cdiv(N, P)
        cache = torch.empty(B * nbr, P, INDEX_DIM + INDEX_SCALE_BYTES, dtype=torch.uint8, device=device)
        flat = cache.view(B * nbr, -1)
        data = flat[:, : P * INDEX_DIM]
        data.copy_(torch.randint(0, 256, data.shape, generator=g, device=device, dtype=torch.uint8))
        data.masked_fill_((data & 0x7F) == 0x7F, 0)  # no e4m3 NaN bytes
        sc = flat[:, P * INDEX_DIM:].view(torch.float32)
        sc.copy_(torch.ldexp(torch.ones_like(sc), torch.randint(-10, -4, sc.shape, generator=g, device=device)))
        bt = _randperm(B * nbr, g, device).view(B, nbr).to(torch.int32)
        if B == T:
            req = torch.arange(T, dtype=torch.int32, device=device)
            vis = torch.full((T,), N, dtype=torch.int32, device=device)
        else:
            req = (torch.arange(T, device=device) * B // T).to(torch.int32)
            vis = (N - T + 1 + torch.arange(T, device=device)).clamp_min(0).to(torch.int32)
        q = _randn((T, H, INDEX_DIM), g, device)
        w = torch.rand(T, H, generator=g, device=device) - 0.3
        return dict(case=case, q=q, weights=w, index_cache=cache, block_table=bt, token_to_req=req,
                    visible_lens=vis)

    def fresh(self, state):
        c = dict(state)
        c["out"] = poison_(torch.empty(state["q"].shape[0], state["case"].entries,
                                       dtype=torch.float32, device=state["q"].device))
        return c

    def invoke(self, fn, call):
        return fn(call["q"], call["weights"], call["index_cache"], call["block_table"],
                  call["token_to_req"], call["visible_lens"], out=call["out"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        if ref is None:
            return None
        T = state["q"].shape[0]
        rows = _sample_rows(T, 0, min(max_ref_tokens or 16, 16), state["q"].device)
        out = ref(state["q"][rows], state["weights"][rows], state["index_cache"], state["block_table"],
                  state["token_to_req"][rows], state["visible_lens"][rows], max_len=state["case"].entries)
        return rows, out

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        rows, want = ref
        got = outputs[rows]
        same_inf = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        fin = ~torch.isinf(want)
        err = rel_err(got[fin], want[fin]) if fin.any() else 0.0
        ok = same_inf and err <= 1e-4
        note = f"checked {rows.numel()} rows" + ("" if same_inf else "; -inf pattern differs")
        return Check(ok, err, float("nan"), None, ref_tokens=int(rows.numel()), note=note)

    def work(self, case, state):
        from .cases import INDEX_DIM

        n = int(state["visible_lens"].long().sum())
        B = state["block_table"].shape[0]
        keys = B * min(case.entries, n) if B > 1 else case.entries
        flops = 2.0 * n * case.heads * INDEX_DIM
        return flops, float(keys * (INDEX_DIM + 4) + case.tokens * case.entries * 4)


class IndexTopkFamily(Family):
    """``index_topk``: ``tokens`` rows of ``entries`` fp32 logits (one value in 7 tied, one
    in 11 ``-inf``), row lengths ``entries`` and a few shorter; bit-exact against the
    reference."""

    name = "index_topk"

    def build(self, case, device, seed):
        g = _gen(device, seed)
        T, N = case.tokens, case.entries
        x = torch.randn(T, N, generator=g, device=device)
        x[:, ::7] = 0.5
        x[:, 5::11] = float("-inf")
        lens = torch.full((T,), N, dtype=torch.int32, device=device)
        lens[1::3] = torch.randint(0, N + 1, (len(range(1, T, 3)),), generator=g, device=device).int()
        return dict(case=case, logits=x, lens=lens)

    def fresh(self, state):
        c = dict(state)
        c["out"] = torch.full((state["logits"].shape[0], state["case"].topk), 0x7777,
                              dtype=torch.int32, device=state["logits"].device)
        return c

    def invoke(self, fn, call):
        return fn(call["logits"], call["lens"], call["case"].topk, out=call["out"])

    def reference(self, state, max_ref_tokens=None):
        ref = reference_fn(self.name)
        return None if ref is None else ref(state["logits"], state["lens"], state["case"].topk)

    def check(self, state, call, outputs, ref):
        if ref is None:
            return Check(None, note="no reference available")
        ok = outputs.shape == ref.shape and torch.equal(outputs, ref)
        frac = 0.0 if ok else (_mismatch_frac(outputs.long(), ref.long()) if outputs.shape == ref.shape else 1.0)
        return Check(ok, frac, float("nan"), ok, note="" if ok else "ids differ")

    def work(self, case, state):
        return 0.0, float(case.tokens * case.entries * 4 + case.tokens * case.topk * 4)


FAMILY_OBJECTS: Dict[str, Family] = {
    f.name: f
    for f in (DecodeFamily(), PrefillFamily(), FusedDecodeFamily(), FusedPrefillFamily(),
              InsertFamily(), GatherFamily(), CombineIndicesFamily(), GlobalTopkFamily(),
              IndexLogitsFamily(), IndexTopkFamily())
}


def get_family(name: str) -> Family:
    return FAMILY_OBJECTS[name]
