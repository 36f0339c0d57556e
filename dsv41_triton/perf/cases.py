"""The case matrix: what the harness runs, per preset and machine.

A :class:`Case` is one problem of one *family* (SPEC §5/§6):

==================  ============================================================
family              what runs
==================  ============================================================
``decode``          ``sparse_mla_decode`` over paged caches (one token/request)
``prefill``         ``sparse_mla_prefill`` over a bf16 workspace
``insert``          ``quantize_and_insert_k_cache``
``gather``          ``dequantize_and_gather_k_cache``
``combine_indices`` ``combine_topk_swa_indices`` (prefill index rows)
``global_topk``     ``compute_global_topk_indices_and_lens`` (decode slots)
``decode_fused``    the fused ("mega") contract of SPEC §6 over paged caches: Q not
                    RoPE'd in, MXFP8 ``(data, scale)`` out, ``layout`` standard or
                    interleaved
``prefill_fused``   the same over a bf16 workspace
``index_logits``    the lightning indexer's logits over paged FP8 index keys
                    (``ops.indexer.index_logits``; opt-in: ``--families``)
``index_topk``      its top-k selection (``ops.indexer.index_topk``; opt-in)
==================  ============================================================

Presets carry the model numbers (heads, top-k, compress ratio, records); the matrix is then
shrunk for ``--quick`` and for machines without a GPU (where the Triton kernels run in the
interpreter and only tiny shapes finish in minutes).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .._contract import KINDS as ATTENTION_FAMILIES
from .._contract import LAYOUTS, WV_GROUP_SIZE

OP_FAMILIES = ("insert", "gather", "combine_indices", "global_topk")
#: run only when named in ``families`` (``--families index_logits,index_topk``)
INDEXER_FAMILIES = ("index_logits", "index_topk")
FAMILIES = ATTENTION_FAMILIES + OP_FAMILIES + INDEXER_FAMILIES
#: index heads and key width of the indexer cases (V4-Flash / V4.1: 64 x 128)
INDEX_HEADS, INDEX_DIM = 64, 128


@dataclass(frozen=True)
class Case:
    """One benchmark problem.

    tokens: query tokens (decode/prefill/index ops), tokens written (insert), or positions
    gathered per request (gather). ratio 0 = window-only layer (no compressed cache, no top-k).
    keys per query = window + topk (compressed layer) or window (window-only).
    """

    family: str
    tokens: int
    heads: int = 0
    swa_record: int = 584  # decode: window cache record; insert/gather: the record
    extra_record: Optional[int] = None  # decode: compressed cache record (None = window-only)
    window: int = 128
    topk: int = 512
    ratio: int = 1
    page: int = 64
    requests: int = 1
    preset: str = ""
    layout: str = "standard"  # fused families: Q / output layout
    q_norm: bool = False  # fused families: per-head Q RMSNorm (V4)
    entries: int = 0  # indexer families: compressed positions (index keys / logits per row)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if self.tokens < 1:
            raise ValueError(f"tokens: expected >= 1, got {self.tokens}")
        if self.family in ATTENTION_FAMILIES and self.heads < 1:
            raise ValueError(f"heads: expected >= 1 for {self.family}, got {self.heads}")
        if self.family.endswith("_fused") and self.heads % WV_GROUP_SIZE:
            raise ValueError(f"heads: the fused contract needs a multiple of {WV_GROUP_SIZE}, "
                             f"got {self.heads}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")

    @property
    def layer(self) -> str:
        """``"swa"`` (window-only) or ``"c<r>"`` (compressed, ratio r)."""
        return "swa" if self.ratio == 0 else f"c{self.ratio}"

    @property
    def keys(self) -> int:
        """Keys attended per query token (attention) or index row width (index ops)."""
        return self.window + (self.topk if self.ratio > 0 else 0)

    @property
    def records(self) -> str:
        if self.family in ("decode", "decode_fused"):
            return f"{self.swa_record}+{self.extra_record}" if self.extra_record else f"{self.swa_record}"
        if self.family in ("insert", "gather"):
            return str(self.swa_record)
        return ""

    @property
    def case_id(self) -> str:
        """Stable identifier (used to join runs in ``--compare``)."""
        f = self.family
        if f == "decode":
            return f"decode/H{self.heads}/T{self.tokens}/{self.layer}/k{self.keys}/r{self.records}"
        if f == "prefill":
            return f"prefill/H{self.heads}/T{self.tokens}/{self.layer}/k{self.keys}"
        if f.endswith("_fused"):
            tail = f"/{self.layout[:5]}" + ("/qnorm" if self.q_norm else "")
            if f == "decode_fused":
                return (f"decode_fused/H{self.heads}/T{self.tokens}/{self.layer}/k{self.keys}"
                        f"/r{self.records}{tail}")
            return f"prefill_fused/H{self.heads}/T{self.tokens}/{self.layer}/k{self.keys}{tail}"
        if f == "insert":
            return f"insert/T{self.tokens}/r{self.swa_record}/p{self.page}"
        if f == "gather":
            return f"gather/B{self.requests}/T{self.tokens}/r{self.swa_record}/p{self.page}"
        if f == "combine_indices":
            return f"combine_indices/T{self.tokens}/B{self.requests}/{self.layer}/k{self.keys}"
        if f == "index_logits":
            return f"index_logits/H{self.heads}/T{self.tokens}/B{self.requests}/N{self.entries}"
        if f == "index_topk":
            return f"index_topk/T{self.tokens}/N{self.entries}/k{self.topk}"
        return f"global_topk/T{self.tokens}/k{self.topk}/p{self.page}"

    def params(self) -> Dict[str, object]:
        """The columns this case contributes to a result row."""
        d = asdict(self)
        d.update(case_id=self.case_id, layer=self.layer, keys=self.keys, records=self.records)
        return d


@dataclass(frozen=True)
class Preset:
    """Model numbers. heads: per-rank head counts to sweep (TP1 first).

    decode_records: (window, compressed) record pairs of decode cases; compressed None =
    window-only layer. fused_records: the pairs of the fused contract's decode cases.
    q_norm: the model re-normalizes each head of Q (V4), which the fused contract fuses.
    """

    name: str
    heads: Tuple[int, ...]
    topk: int
    ratios: Tuple[int, ...]  # compressed-layer ratios of the model (first one is used for decode)
    decode_records: Tuple[Tuple[int, Optional[int]], ...]
    op_records: Tuple[int, ...]
    window: int = 128
    fused_records: Tuple[Tuple[int, Optional[int]], ...] = ()
    q_norm: bool = False
    description: str = ""


def _from_model(name: str, model: str, tp: Tuple[int, ...], **kw) -> Preset:
    """A preset whose heads / top-k / window / ratios come from ``layers.config``."""
    from ..layers.config import DeepseekV41AttentionConfig as Cfg

    cfg = {"v41-flash": Cfg.v41_flash, "v4-flash": Cfg.v4_flash, "v4-pro": Cfg.v4_pro}[model]()
    H = cfg.num_attention_heads
    ratios = tuple(sorted({r for r in cfg.compress_ratios if r > 0}))
    heads = tuple(H // t for t in tp)
    desc = (f"{cfg.name}: {H} heads (per rank at TP{'/'.join(map(str, tp))}: "
            f"{'/'.join(map(str, heads))}), top-k {cfg.index_topk}, window {cfg.sliding_window}, "
            f"compress ratios {'/'.join(map(str, ratios))}")
    return Preset(name, heads, cfg.index_topk, ratios, window=cfg.sliding_window,
                  q_norm=cfg.q_head_norm, description=kw.pop("description", desc), **kw)


def _presets() -> Dict[str, Preset]:
    v41 = dict(decode_records=((584, 584), (528, 528), (528, 288), (584, None), (528, None)),
               op_records=(584, 528, 288), fused_records=((528, 288), (584, 584)))
    v4 = dict(decode_records=((584, 584), (584, None)), op_records=(584,),
              fused_records=((584, 584),))
    return {p.name: p for p in (
        _from_model("v41-flash", "v41-flash", (1, 4, 8), **v41),
        _from_model("v4-flash", "v4-flash", (1, 4, 8), **v4),
        _from_model("v4-pro", "v4-pro", (1, 8), **v4),
        _from_model("tp8", "v41-flash", (8,), description="V4.1-Flash at TP8: 8 local heads",
                    **dict(v41, decode_records=((584, 584), (528, 288), (584, None)))),
    )}


_PRESETS: Dict[str, Preset] = {}


def presets() -> Dict[str, Preset]:
    """``{name: Preset}`` (built on first use: the model numbers come from
    ``layers.config``, imported only once the CLI has set up Triton)."""
    if not _PRESETS:
        _PRESETS.update(_presets())
    return _PRESETS


PRESET_NAMES = ("v41-flash", "v4-flash", "v4-pro", "tp8")


def __getattr__(name):  # ``cases.PRESETS``, lazily
    if name == "PRESETS":
        return presets()
    raise AttributeError(name)
DEFAULT_PRESET = "v41-flash"


def get_preset(name: str) -> Preset:
    if name not in PRESET_NAMES:
        raise ValueError(f"preset: expected one of {sorted(PRESET_NAMES)}, got {name!r}")
    return presets()[name]


def build_cases(
    preset: str = DEFAULT_PRESET,
    *,
    gpu: bool = True,
    quick: bool = False,
    families: Optional[Sequence[str]] = None,
) -> List[Case]:
    """The case list for a preset. ``gpu=False`` gives the tiny interpreter matrix (CPU)."""
    p = get_preset(preset)
    if families is not None:
        bad = [f for f in families if f not in FAMILIES]
        if bad:
            raise ValueError(f"families: unknown {bad}; expected some of {list(FAMILIES)}")
    make = _gpu_cases if gpu else _cpu_cases
    cases = make(p, quick)
    if families is not None and any(f in INDEXER_FAMILIES for f in families):
        cases += _indexer_cases(gpu, quick)
    if families is not None:
        cases = [c for c in cases if c.family in families]
    # de-duplicate (keeping order), stamp the preset
    seen, out = set(), []
    for c in cases:
        c = replace(c, preset=p.name)
        if c.case_id not in seen:
            seen.add(c.case_id)
            out.append(c)
    return out


def _gpu_cases(p: Preset, quick: bool) -> List[Case]:
    r = p.ratios[0]
    W, K = p.window, p.topk
    cases: List[Case] = []
    if quick:
        heads = sorted({max(p.heads), min(p.heads)}, reverse=True)
        swa, extra = p.decode_records[0]
        for h in heads:
            for t in (1, 128):
                cases.append(Case("decode", t, h, swa, extra, W, K, r if extra else 0, requests=t))
        cases.append(Case("prefill", 4096, max(p.heads), window=W, topk=K, ratio=r))
        fs, fe = (p.fused_records or p.decode_records)[0]
        cases.append(Case("decode_fused", 128, max(p.heads), fs, fe, W, K, r, requests=128,
                          layout="interleaved", q_norm=p.q_norm))
        cases.append(Case("prefill_fused", 1024, max(p.heads), window=W, topk=K, ratio=r,
                          layout="interleaved", q_norm=p.q_norm))
        rec = p.op_records[0]
        cases += [
            Case("insert", 32768, swa_record=rec),
            Case("gather", 32768, swa_record=rec, requests=4),
            Case("combine_indices", 8192, window=W, topk=K, ratio=r, requests=4),
            Case("global_topk", 8192, topk=K),
        ]
        return cases
    for swa, extra in p.decode_records:
        for h in p.heads:
            for t in (1, 32, 128, 512):
                cases.append(Case("decode", t, h, swa, extra, W, K, r if extra else 0, requests=t))
    for h in p.heads:
        for t in (1024, 4096):
            cases.append(Case("prefill", t, h, window=W, topk=K, ratio=r))
        cases.append(Case("prefill", 4096, h, window=W, topk=K, ratio=0))
    big, small = max(p.heads), min(p.heads)
    for fs, fe in p.fused_records:
        for h in sorted({big, small}, reverse=True):
            for t in (1, 32, 128, 512):
                cases.append(Case("decode_fused", t, h, fs, fe, W, K, r, requests=t,
                                  layout="interleaved", q_norm=p.q_norm))
    if p.fused_records:
        fs, fe = p.fused_records[0]
        cases.append(Case("decode_fused", 128, big, fs, fe, W, K, r, requests=128,
                          layout="standard", q_norm=p.q_norm))
        for h in sorted({big, small}, reverse=True):
            cases.append(Case("prefill_fused", 4096, h, window=W, topk=K, ratio=r,
                              layout="interleaved", q_norm=p.q_norm))
    for rec in p.op_records:
        cases.append(Case("insert", 32768, swa_record=rec))
        for b, t in ((4, 8192), (4, 32768)):
            cases.append(Case("gather", t, swa_record=rec, requests=b))
    for ratio in p.ratios + (0,):
        cases.append(Case("combine_indices", 8192, window=W, topk=K, ratio=ratio, requests=4))
    for t in (1024, 8192):
        cases.append(Case("global_topk", t, topk=K))
    return cases


# Interpreter shapes: small windows/top-k and pages keep the CPU run to a few minutes on 2
# cores while still crossing page boundaries and using odd head/token counts.
CPU_WINDOW, CPU_TOPK, CPU_PAGE = 16, 32, 16


def _cpu_cases(p: Preset, quick: bool) -> List[Case]:
    r = p.ratios[0]
    W, K, P = CPU_WINDOW, CPU_TOPK, CPU_PAGE
    h = min(p.heads)
    swa, extra = p.decode_records[0]
    cases = [Case("decode", 1, h, swa, extra, W, K, r, P, requests=1)]
    if not quick:
        cases.append(Case("decode", 4, h, swa, extra, W, K, r, P, requests=4))
        cases.append(Case("decode", 3, 3, swa, extra, W, K, r, P, requests=3))
        for s2, e2 in p.decode_records[1:]:
            if e2 is None:
                cases.append(Case("decode", 2, h, s2, None, W, K, 0, P, requests=2))
                break
        others = [(s2, e2) for s2, e2 in p.decode_records[1:] if e2 is not None]
        others.sort(key=lambda se: se[1] != 288)  # prefer the NVFP4 compressed cache
        for s2, e2 in others[:1]:
            cases.append(Case("decode", 2, h, s2, e2, W, K, r, P, requests=2))
    cases.append(Case("prefill", 5, h, window=W, topk=K, ratio=r, page=P))
    if not quick:
        cases.append(Case("prefill", 2, h, window=W, topk=K, ratio=r, page=P))
        cases.append(Case("prefill", 3, 3, window=W, topk=K, ratio=0, page=P))
    if p.fused_records:
        fs, fe = p.fused_records[0]
        cases.append(Case("decode_fused", 2, 8, fs, fe, W, K, r, P, requests=2,
                          layout="interleaved", q_norm=p.q_norm))
        if not quick:
            cases.append(Case("prefill_fused", 3, 8, window=W, topk=K, ratio=r, page=P,
                              layout="standard", q_norm=p.q_norm))
    recs = p.op_records if not quick else p.op_records[:1]
    for rec in recs:
        cases.append(Case("insert", 7, swa_record=rec, page=P))
    cases.append(Case("gather", 21, swa_record=p.op_records[0], page=P, requests=2))
    cases.append(Case("combine_indices", 7, window=W, topk=K, ratio=r, page=P, requests=2))
    cases.append(Case("global_topk", 7, topk=K, page=P))
    return cases


def _indexer_cases(gpu: bool, quick: bool) -> List[Case]:
    """Index logits (decode: one token per request; prefill: one request's last tokens) and
    top-k at 8K / 128K / 1M compressed positions (tiny shapes for the interpreter)."""
    H = INDEX_HEADS
    if not gpu:
        return [Case("index_logits", 3, 3, requests=3, entries=200, page=CPU_PAGE),
                Case("index_logits", 5, 3, requests=1, entries=96, page=CPU_PAGE),
                Case("index_topk", 4, topk=32, entries=300),
                Case("index_topk", 3, topk=512, entries=2100)]
    decode = [(8192, 64), (131072, 64), (1048576, 16)] if not quick else [(8192, 64), (1048576, 16)]
    cases = [Case("index_logits", t, H, requests=t, entries=n) for n, t in decode]
    cases += [Case("index_logits", 1024, H, requests=1, entries=n)
              for n in ((8192, 131072) if not quick else (8192,))]
    for n, t in decode:
        for k in ((512, 1024) if not quick else (512,)):
            cases.append(Case("index_topk", t, topk=k, entries=n))
    return cases
