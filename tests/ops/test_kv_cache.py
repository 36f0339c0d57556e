"""quantize_and_insert_k_cache / dequantize_and_gather_k_cache: Triton kernels vs the PyTorch
references vs an independent loop oracle written from SPEC §4-§5, for the 584/528/288 records.

Caches live inside a bigger random-byte buffer and the whole buffer is compared bit for bit, so
a stray write anywhere (padding, other rows, bytes before/after the cache) is caught. Gather
outputs are poisoned (NaN) and also live inside bigger buffers.
"""
import pytest
import torch

from dsv41_triton.ops.kv_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache
from dsv41_triton.ops.kv_cache_ref import (
    dequantize_and_gather_k_cache_ref,
    quantize_and_insert_k_cache_ref,
)
from dsv41_triton.ops.records import (
    check_k_cache,
    encode_records_ref,
    get_record_format,
    quantize_dequantize_ref,
    read_slots_ref,
    record_views,
)
from dsv41_triton.testing import poison_, rel_err

RECORDS = [584, 528, 288]
LEAD, TAIL = 32, 48  # random bytes before / after the cache inside its buffer


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_cache(num_blocks, page, record, device, *, block_stride=None, four_d=False):
    """A random-byte cache inside a bigger random-byte buffer. Returns (buffer, cache)."""
    fmt = get_record_format(record)
    s0 = fmt.block_bytes(page) if block_stride is None else block_stride
    buf = torch.randint(0, 256, (LEAD + num_blocks * s0 + TAIL,), dtype=torch.uint8, device=device)
    cache = buf.as_strided((num_blocks, page, fmt.record_bytes), (s0, fmt.record_bytes, 1), LEAD)
    return buf, (cache.unsqueeze(2) if four_d else cache)


def same_geometry(buf, cache):
    """A copy of ``buf`` and the view of ``cache``'s geometry into it."""
    buf2 = buf.clone()
    return buf2, buf2.as_strided(cache.shape, cache.stride(), cache.storage_offset())


def random_k(T, device, *, row_stride=None):
    """bf16 [T, 512], never zero: token magnitudes over 2**±6, per-16-dim groups over 2**±2, and
    a few tiny groups (below the UE8M0 amax floor / the NVFP4 scale floor)."""
    x = torch.randn(T, 512, device=device)
    x *= torch.exp2(torch.randint(-6, 7, (T, 1), device=device).float())
    x *= torch.exp2(torch.randint(-2, 3, (T, 32, 1), device=device).float()).expand(T, 32, 16).reshape(T, 512)
    if T > 2:
        x[1, 64:192] *= 1e-7
        x[2, :32] *= 1e-30
    if row_stride is not None:  # a view with a row stride != 512
        big = torch.randn(T, row_stride, device=device).to(torch.bfloat16)
        big[:, 7 : 7 + 512] = x.to(torch.bfloat16)
        return big[:, 7 : 7 + 512]
    return x.to(torch.bfloat16)


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def expected_insert(buf, cache, k, slots):
    """Loop oracle from SPEC §4: the buffer after inserting ``k`` at ``slots``."""
    fmt, c3 = check_k_cache("k_cache", cache)
    page, s0, base = c3.shape[1], c3.stride(0), c3.storage_offset()
    data, scales = encode_records_ref(k, fmt)
    exp = buf.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0 or s >= c3.shape[0] * page:
            continue
        blk, off = divmod(s, page)
        d = base + blk * s0 + off * fmt.data_bytes
        sc = base + blk * s0 + page * fmt.data_bytes + off * fmt.scale_bytes
        exp[d : d + fmt.data_bytes] = data[t]
        exp[sc : sc + fmt.scale_bytes] = scales[t]
    return exp


def check_insert(record, device, k, slots, *, num_blocks, page, **cache_kw):
    buf, cache = make_cache(num_blocks, page, record, device, **cache_kw)
    buf_r, cache_r = same_geometry(buf, cache)
    exp = expected_insert(buf, cache, k, slots)
    quantize_and_insert_k_cache(k, cache, slots)
    quantize_and_insert_k_cache_ref(k, cache_r, slots)
    assert torch.equal(buf, exp), f"kernel: {(buf != exp).sum().item()} bytes differ"
    assert torch.equal(buf_r, exp), "reference differs from the SPEC oracle"
    return buf, cache


def fill_cache(cache, device):
    """Write a valid record (of random k) into every slot; returns the decoded rows [slots, 512]."""
    fmt, c3 = check_k_cache("k_cache", cache)
    n = c3.shape[0] * c3.shape[1]
    k = random_k(n, device)
    quantize_and_insert_k_cache_ref(k, c3, torch.arange(n, device=device))
    return quantize_dequantize_ref(k, fmt)


def expected_gather(out_buf, out, rows_by_slot, seq_lens, gather_lens, block_table, page, offset):
    """Loop oracle from SPEC §5 (plus the documented skips): ``out_buf`` after the gather."""
    exp = out_buf.clone()
    view = exp.as_strided(out.shape, out.stride(), out.storage_offset())
    B, M = out.shape[0], out.shape[1]
    nb = rows_by_slot.shape[0] // page
    bt = block_table.tolist()
    written = 0
    for b in range(B):
        seq = int(seq_lens[b])
        g = seq if gather_lens is None else int(gather_lens[b])
        for i in range(max(g, 0)):
            pos, row = seq - g + i, offset + i
            if row >= M or pos < 0 or pos // page >= len(bt[b]):
                continue
            blk = bt[b][pos // page]
            if blk < 0 or blk >= nb:
                continue
            view[b, row] = rows_by_slot[blk * page + pos % page]
            written += 1
    return exp, written


def check_gather(record, device, *, num_blocks, page, seq_lens, gather_lens, block_table, M,
                 offset, out_layout="slice", min_written=1, **cache_kw):
    _, cache = make_cache(num_blocks, page, record, device, **cache_kw)
    rows = fill_cache(cache, device)
    B = len(seq_lens)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if gather_lens is not None:
        gather_lens = torch.tensor(gather_lens, dtype=torch.int32, device=device)
    block_table = torch.as_tensor(block_table, dtype=torch.int32).to(device)
    if out_layout == "slice":  # a slice of a bigger workspace: rows >= M exist in memory
        buf = poison_(torch.empty(B + 1, M + 5, 512, dtype=torch.bfloat16, device=device))
        out = buf[1:, 2 : M + 2]
    elif out_layout == "transposed":  # dims 0-1 swapped in memory
        buf = poison_(torch.empty(M + 3, B, 512, dtype=torch.bfloat16, device=device))
        out = buf[:M].transpose(0, 1)
    else:
        buf = poison_(torch.empty(B, M, 512, dtype=torch.bfloat16, device=device))
        out = buf
    buf_r = buf.clone()
    out_r = buf_r.as_strided(out.shape, out.stride(), out.storage_offset())
    exp, written = expected_gather(buf, out, rows, seq_lens.cpu(), None if gather_lens is None
                                   else gather_lens.cpu(), block_table.cpu(), page, offset)
    assert written >= min_written  # the case exercises what it claims to
    args = (seq_lens, gather_lens, block_table, page, offset)
    dequantize_and_gather_k_cache(out, cache, *args)
    dequantize_and_gather_k_cache_ref(out_r, cache, *args)
    assert torch.equal(bits(buf), bits(exp)), "kernel differs from the SPEC oracle"
    assert torch.equal(bits(buf_r), bits(exp)), "reference differs from the SPEC oracle"


def distinct_blocks(B, cols, num_blocks, device="cpu"):
    return torch.randperm(num_blocks)[: B * cols].view(B, cols).to(torch.int32).to(device)


# ---------------------------------------------------------------------------------------------
# insert
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record", RECORDS)
def test_insert_random_slots(record, device):
    nb, page, T = 5, 16, 37
    special = torch.tensor([0, page - 1, page, nb * page - 1])  # page boundaries, last slot
    rest = torch.randperm(nb * page)
    rest = rest[~torch.isin(rest, special)]
    slots = torch.cat([special, rest[: T - 4]])  # distinct
    slots[4 + torch.randperm(T - 4)[:6]] = -1
    slots = slots[torch.randperm(T)]
    check_insert(record, device, random_k(T, device), slots.int().to(device), num_blocks=nb, page=page)


@pytest.mark.parametrize("record", RECORDS)
def test_insert_one_token_int64_slots(record, device):
    nb, page = 3, 8
    slot = torch.tensor([nb * page - 2], dtype=torch.int64, device=device)
    check_insert(record, device, random_k(1, device), slot, num_blocks=nb, page=page)


@pytest.mark.parametrize("record", RECORDS)
def test_insert_seven_tokens_padded_stride_4d(record, device):
    """Block stride larger than the page (padding must stay untouched), a 4-D cache view, k rows
    with a stride != 512, int64 slots with -1 and a slot past the cache (skipped)."""
    nb, page = 4, 4
    fmt = get_record_format(record)
    slots = torch.tensor([5, -1, 15, 0, 16 + 3, 8, -1], dtype=torch.int64, device=device)
    k = random_k(7, device, row_stride=600)
    assert k.stride(0) == 600
    check_insert(record, device, k, slots, num_blocks=nb, page=page,
                 block_stride=fmt.block_bytes(page) + 1024, four_d=True)


@pytest.mark.parametrize("record", RECORDS)
def test_insert_all_minus_one_and_empty(record, device):
    nb, page = 2, 16
    k = random_k(9, device)
    buf, cache = check_insert(record, device, k, torch.full((9,), -1, dtype=torch.int32, device=device),
                              num_blocks=nb, page=page)
    before = buf.clone()
    quantize_and_insert_k_cache(k[:0], cache, torch.empty(0, dtype=torch.int32, device=device))
    assert torch.equal(buf, before)


@pytest.mark.parametrize("record", RECORDS)
def test_insert_rounding_edge_cases(record, device):
    """e4m3 and e2m1 ties, saturation at 448 / 6, the amax floors, signs of tiny values."""
    T = 5
    x = torch.randn(T, 512).abs() + 0.1
    grp = torch.tensor([448.0, 1.0625, 1.1875, 1.3125, 17.0, 19.0, 2.0**-9, 2.0**-10,
                        -2.0**-10, -1.0625, 448.0 * 0.999, 0.5])
    x[0, :12] = grp  # e4m3 ties at e = 0 (amax exactly 448, group of 32 or 64)
    x[0, 32:44] = grp * 2.0**-12  # the same at e = -12
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0])
    for g, s in enumerate([1.0, 0.5, 2.0**-7, 2.0**-9, 448.0, 0.875, 3.0, 2.0**-3]):
        x[1, 16 * g : 16 * g + 16] = ties * s  # NVFP4 ties (s exact, amax = 6 s)
        x[2, 16 * g : 16 * g + 16] = ties.flip(0) * s * 1.03  # amax/6 rounds in e4m3
    x[3] = torch.randn(512) * 1e-6  # everything under the floors
    x[3, ::3] *= -1
    x[4] = torch.randn(512) * 3000  # NVFP4 scale saturates at 448
    if device == "cpu" or record != 288:
        # bf16 subnormals; the GPU divides with FTZ libdevice, so an NVFP4 zero code could get
        # a different sign there: skipped for 288 on the GPU (documented in kv_cache.py)
        x[3, :8] = torch.tensor([1e-39, -1e-39, 3e-40, -5e-40, 1e-38, -1e-38, 2e-45, -2e-41])
    k = x.to(torch.bfloat16).to(device)
    slots = torch.tensor([3, 0, 7, 2, 5], dtype=torch.int32, device=device)
    check_insert(record, device, k, slots, num_blocks=2, page=4)


# ---------------------------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record", RECORDS)
def test_gather_basic(record, device):
    """Four requests incl. an empty one, a gather that ends on a page boundary, offset > 0, a
    workspace that is a slice of a bigger buffer."""
    page = 16
    check_gather(record, device, num_blocks=20, page=page, seq_lens=[37, 16, 5, 0],
                 gather_lens=[20, 16, 5, 0], block_table=distinct_blocks(4, 4, 20), M=24, offset=2)


@pytest.mark.parametrize("record", RECORDS)
def test_gather_no_gather_lens_transposed_out(record, device):
    page = 8
    check_gather(record, device, num_blocks=12, page=page, seq_lens=[17, 8, 1],
                 gather_lens=None, block_table=distinct_blocks(3, 3, 12), M=20, offset=0,
                 out_layout="transposed")


@pytest.mark.parametrize("record", RECORDS)
def test_gather_clipped_at_M_and_skips(record, device):
    """g > M - offset (rows past M must stay untouched: the workspace slice has memory there),
    a -1 block-table entry inside the gathered range, a block id past the cache, a block table
    too short for the sequence, and gather_len > seq_len (negative positions)."""
    page, nb = 4, 24
    bt = distinct_blocks(4, 5, nb)
    bt[0, 2] = -1
    bt[1, 1] = nb + 3
    bt2 = bt[:, :4]  # a non-contiguous block table; request 2 needs 5 columns
    check_gather(record, device, num_blocks=nb, page=page, seq_lens=[18, 12, 20, 3],
                 gather_lens=[18, 12, 6, 6], block_table=bt2, M=15, offset=3)


@pytest.mark.parametrize("record", RECORDS)
def test_gather_one_token_padded_stride_4d(record, device):
    fmt = get_record_format(record)
    check_gather(record, device, num_blocks=3, page=4, seq_lens=[6], gather_lens=[1],
                 block_table=[[2, 0]], M=1, offset=0, out_layout="plain",
                 block_stride=fmt.block_bytes(4) + 512, four_d=True)


@pytest.mark.parametrize("record", RECORDS)
def test_gather_negative_gather_len_and_offset_at_M(record, device):
    page = 4
    check_gather(record, device, num_blocks=8, page=page, seq_lens=[7, 5],
                 gather_lens=[-3, 5], block_table=distinct_blocks(2, 2, 8), M=9, offset=4)
    # offset == M: nothing to gather; B == 0: nothing either
    _, cache = make_cache(2, page, record, device)
    out = poison_(torch.empty(2, 3, 512, dtype=torch.bfloat16, device=device))
    lens = torch.tensor([5, 5], dtype=torch.int32, device=device)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=device)
    dequantize_and_gather_k_cache(out, cache, lens, None, bt, page, 3)
    assert torch.isnan(out.float()).all()
    dequantize_and_gather_k_cache(out[:0], cache, lens[:0], None, bt[:0], page, 0)
    # a block table with no columns: nothing to read
    dequantize_and_gather_k_cache(out, cache, lens, None, bt[:, :0], page, 0)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("record", RECORDS)
def test_gather_many_chunks(record, device):
    """More positions than one program handles, a multi-page sequence."""
    page = 16
    check_gather(record, device, num_blocks=16, page=page, seq_lens=[70, 45],
                 gather_lens=[70, 33], block_table=distinct_blocks(2, 6, 16), M=72, offset=1,
                 min_written=100)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows to inf
@pytest.mark.parametrize("record", RECORDS)
def test_gather_arbitrary_bytes(record, device):
    """Records of random bytes (UE8M0 bytes 0 and 255, e4m3 subnormals, NaN codes): bit-equal to
    the reference wherever the reference is not NaN (NaN payloads are not pinned)."""
    page, nb = 16, 8
    _, cache = make_cache(nb, page, record, device)
    fmt = get_record_format(record)
    _, scales = record_views(cache, fmt)
    scales[1, 2, :3] = torch.tensor([0, 255, 1], dtype=torch.uint8, device=device)
    bt = distinct_blocks(2, 4, nb, device)
    bt[0, 0] = 1
    seq = torch.tensor([64, 50], dtype=torch.int32, device=device)
    out = poison_(torch.empty(2, 64, 512, dtype=torch.bfloat16, device=device))
    out_r = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq, None, bt, page, 0)
    dequantize_and_gather_k_cache_ref(out_r, cache, seq, None, bt, page, 0)
    ref_nan = torch.isnan(out_r)
    assert ((bits(out) == bits(out_r)) | ref_nan).all()
    assert not torch.isnan(out_r[1, :50]).all() and torch.isnan(out_r[1, 50:]).all()
    if device == "cuda":
        assert torch.equal(torch.isnan(out), ref_nan)


# ---------------------------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record", RECORDS)
def test_insert_gather_round_trip(record, device):
    page, nb, B = 8, 10, 3
    seq = [19, 8, 1]
    bt = distinct_blocks(B, 3, nb, device)
    _, cache = make_cache(nb, page, record, device)
    ks = [torch.randn(n, 512, device=device).to(torch.bfloat16) for n in seq]
    for b, k in enumerate(ks):
        pos = torch.arange(len(k), device=device)
        slots = bt[b, pos // page].long() * page + pos % page
        quantize_and_insert_k_cache(k, cache, slots)
    M = max(seq)
    out = poison_(torch.empty(B, M, 512, dtype=torch.bfloat16, device=device))
    dequantize_and_gather_k_cache(out, cache, torch.tensor(seq, dtype=torch.int32, device=device),
                                  None, bt, page, 0)
    bound = {584: 0.04, 528: 0.04, 288: 0.11}[record]
    for b, k in enumerate(ks):
        assert torch.equal(bits(out[b, : len(k)]), bits(quantize_dequantize_ref(k, record)))
        assert 0 < rel_err(out[b, : len(k)], k) < bound
        assert torch.isnan(out[b, len(k) :].float()).all()


# ---------------------------------------------------------------------------------------------
# int64 addressing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record", [584, 288])
def test_cache_beyond_2gib(record, device):
    """A cache whose third block starts past byte 2**31 (the block stride itself fits in int32,
    so only int64 math reaches it). The cache is an uninitialised ~2 GiB allocation of which only
    the checked bytes are ever touched (CPU: lazily mapped pages, the interpreter writes back in
    place)."""
    fmt = get_record_format(record)
    page = 16
    s0 = (1 << 30) + (1 << 20)
    size = 2 * s0 + page * fmt.record_bytes
    storage = torch.empty(size, dtype=torch.uint8, device=device)
    cache = storage.as_strided((3, page, fmt.record_bytes), (s0, fmt.record_bytes, 1))
    lo = 2 * s0 - 4096  # the window we look at: the end of block 1's padding and block 2
    win = storage[lo:]
    win.copy_(torch.randint(0, 256, win.shape, dtype=torch.uint8, device=device))
    before = win.clone()
    k = random_k(9, device)
    p2 = 2 * page
    slots = torch.tensor([p2 + 3, p2 + 4, -1, 3 * page - 1, p2 + 5, p2 + 6, p2 + 7, p2 + 8, p2],
                         device=device)
    quantize_and_insert_k_cache(k, cache, slots)
    # oracle on the window alone (the same bytes at offset 4096 of a small buffer)
    small = before.clone()
    view = small.as_strided((1, page, fmt.record_bytes), (s0, fmt.record_bytes, 1), 4096)
    quantize_and_insert_k_cache_ref(k, view, torch.where(slots >= 0, slots - 2 * page, slots))
    assert not torch.equal(small, before)
    assert torch.equal(win, small)
    # gather back from block 2
    out = poison_(torch.empty(1, 6, 512, dtype=torch.bfloat16, device=device))
    bt = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    seq = torch.tensor([page + 9], dtype=torch.int32, device=device)  # positions 19..24 -> block 2
    dequantize_and_gather_k_cache(out, cache, seq, torch.tensor([6], dtype=torch.int32,
                                                                device=device), bt, page, 0)
    want = read_slots_ref(view, torch.arange(3, 9, device=device))
    assert torch.equal(want, quantize_dequantize_ref(k[[0, 1, 4, 5, 6, 7]], record))
    assert torch.equal(bits(out[0]), bits(want))
    del storage, cache, win


@pytest.mark.gpu
def test_workspace_beyond_2g_elements(device):
    """``out`` rows past element 2**31 (int64 workspace offsets; the batch stride itself fits in
    int32, so only int64 math reaches request 2). Needs ~4 GiB: GPU only."""
    page = 64
    _, cache = make_cache(4, page, 584, device)
    rows = fill_cache(cache, device)
    so = (1 << 30) + 512
    storage = torch.empty(2 * so + 8 * 512, dtype=torch.bfloat16, device=device)
    out = storage.as_strided((3, 8, 512), (so, 512, 1))
    for b in range(3):
        poison_(out[b])
    seq = torch.tensor([70, 0, 130], dtype=torch.int32, device=device)
    bt = torch.tensor([[3, 1, -1], [0, 0, 0], [0, 2, 1]], dtype=torch.int32, device=device)
    gl = torch.tensor([8, 0, 8], dtype=torch.int32, device=device)
    dequantize_and_gather_k_cache(out, cache, seq, gl, bt, page, 0)
    ar = torch.arange(8, device=device)
    want0 = rows[(62 + ar) % page + torch.tensor([3] * 2 + [1] * 6, device=device) * page]
    want2 = rows[(122 + ar) % page + torch.tensor([2] * 6 + [1] * 2, device=device) * page]
    assert torch.equal(bits(out[0]), bits(want0))
    assert torch.isnan(out[1].float()).all()
    assert torch.equal(bits(out[2]), bits(want2))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def _insert_args(device):
    _, cache = make_cache(2, 4, 584, device)
    k = random_k(3, device)
    return dict(k=k, k_cache=cache, slot_mapping=torch.tensor([0, 5, -1], dtype=torch.int32, device=device))


INSERT_BAD = {
    "k float32": (lambda a: {**a, "k": a["k"].float()}, TypeError, "k"),
    "k head dim": (lambda a: {**a, "k": a["k"][:, :256]}, ValueError, "k"),
    "k 3-D": (lambda a: {**a, "k": a["k"].unsqueeze(1)}, ValueError, "k"),
    "k last dim strided": (lambda a: {**a, "k": torch.cat([a["k"], a["k"]], 1)[:, ::2]}, ValueError, "k"),
    "cache int8": (lambda a: {**a, "k_cache": a["k_cache"].view(torch.int8)}, TypeError, "k_cache"),
    "cache width": (lambda a: {**a, "k_cache": a["k_cache"][:, :, :576]}, ValueError, "k_cache"),
    "cache 2-D": (lambda a: {**a, "k_cache": a["k_cache"][0]}, ValueError, "k_cache"),
    "slots float": (lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}, TypeError, "slot_mapping"),
    "slots int16": (lambda a: {**a, "slot_mapping": a["slot_mapping"].short()}, TypeError, "slot_mapping"),
    "slots length": (lambda a: {**a, "slot_mapping": a["slot_mapping"][:2]}, ValueError, "slot_mapping"),
    "slots 2-D": (lambda a: {**a, "slot_mapping": a["slot_mapping"].view(3, 1)}, ValueError, "slot_mapping"),
    "slots device": (lambda a: {**a, "slot_mapping": a["slot_mapping"].to("meta")}, ValueError, "slot_mapping"),
    "k not a tensor": (lambda a: {**a, "k": a["k"].tolist()}, TypeError, "k"),
}


@pytest.mark.parametrize("op", ["kernel", "ref"])
@pytest.mark.parametrize("case", list(INSERT_BAD))
def test_insert_bad_input(case, op, device):
    fn = quantize_and_insert_k_cache if op == "kernel" else quantize_and_insert_k_cache_ref
    a = _insert_args(device)
    before = a["k_cache"].clone()
    mutate, exc, name = INSERT_BAD[case]
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn(**mutate(a))
    assert torch.equal(a["k_cache"], before)


def _gather_args(device):
    _, cache = make_cache(3, 4, 528, device)
    fill_cache(cache, device)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(out=poison_(torch.empty(2, 6, 512, dtype=torch.bfloat16, device=device)),
                k_cache=cache, seq_lens=torch.tensor([5, 3], **i32), gather_lens=torch.tensor([4, 3], **i32),
                block_table=torch.tensor([[0, 1], [2, -1]], **i32), block_size=4, offset=1)


GATHER_BAD = {
    "out float32": (lambda a: {**a, "out": a["out"].float()}, TypeError, "out"),
    "out head dim": (lambda a: {**a, "out": a["out"][..., :448]}, ValueError, "out"),
    "out 2-D": (lambda a: {**a, "out": a["out"][0]}, ValueError, "out"),
    "out last dim strided": (lambda a: {**a, "out": torch.empty(2, 6, 1024, dtype=torch.bfloat16,
                                                                device=a["out"].device)[..., ::2]},
                             ValueError, "out"),
    "cache width": (lambda a: {**a, "k_cache": a["k_cache"][:, :, :512]}, ValueError, "k_cache"),
    "cache dtype": (lambda a: {**a, "k_cache": a["k_cache"].view(torch.int8)}, TypeError, "k_cache"),
    "seq_lens int64": (lambda a: {**a, "seq_lens": a["seq_lens"].long()}, TypeError, "seq_lens"),
    "gather_lens int64": (lambda a: {**a, "gather_lens": a["gather_lens"].long()}, TypeError, "gather_lens"),
    "block_table int64": (lambda a: {**a, "block_table": a["block_table"].long()}, TypeError, "block_table"),
    "block_table 1-D": (lambda a: {**a, "block_table": a["block_table"][0]}, ValueError, "block_table"),
    "seq_lens length": (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens"),
    "gather_lens length": (lambda a: {**a, "gather_lens": a["gather_lens"].repeat(2)}, ValueError, "gather_lens"),
    "block_table rows": (lambda a: {**a, "block_table": a["block_table"][:1]}, ValueError, "block_table"),
    "block_size mismatch": (lambda a: {**a, "block_size": 8}, ValueError, "block_size"),
    "block_size float": (lambda a: {**a, "block_size": 4.0}, TypeError, "block_size"),
    "offset negative": (lambda a: {**a, "offset": -1}, ValueError, "offset"),
    "offset past M": (lambda a: {**a, "offset": 7}, ValueError, "offset"),
    "offset float": (lambda a: {**a, "offset": 1.0}, TypeError, "offset"),
    "seq_lens device": (lambda a: {**a, "seq_lens": a["seq_lens"].to("meta")}, ValueError, "seq_lens"),
    "block_table device": (lambda a: {**a, "block_table": a["block_table"].to("meta")}, ValueError,
                           "block_table"),
}


@pytest.mark.parametrize("op", ["kernel", "ref"])
@pytest.mark.parametrize("case", list(GATHER_BAD))
def test_gather_bad_input(case, op, device):
    fn = dequantize_and_gather_k_cache if op == "kernel" else dequantize_and_gather_k_cache_ref
    a = _gather_args(device)
    cache_before = a["k_cache"].clone()
    mutate, exc, name = GATHER_BAD[case]
    bad = mutate(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn(**bad)
    assert torch.equal(a["k_cache"], cache_before)
    assert torch.isnan(a["out"].float()).all()


def test_bad_args_are_accepted_when_fixed(device):
    """The unmutated argument sets above are valid (so every bad case fails for its own reason)."""
    a = _insert_args(device)
    quantize_and_insert_k_cache(**a)
    g = _gather_args(device)
    dequantize_and_gather_k_cache(**g)
    assert not torch.isnan(g["out"][0, 1:5].float()).any() and torch.isnan(g["out"][0, 0].float()).all()


# ---------------------------------------------------------------------------------------------
# realistic sizes (GPU)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("record", RECORDS)
def test_gpu_gather_4x32k(record, device):
    page, B, L = 64, 4, 32768
    nb = B * (L // page) + 64
    _, cache = make_cache(nb, page, record, device)
    fill_cache(cache, device)
    bt = distinct_blocks(B, L // page + 1, nb, device)
    seq = torch.tensor([L, L - 5, L - 64, L - 1000], dtype=torch.int32, device=device)
    for gl in (None, torch.tensor([L, 4000, L - 64, 1], dtype=torch.int32, device=device)):
        out = poison_(torch.empty(B, L + 8, 512, dtype=torch.bfloat16, device=device))
        out_r = out.clone()
        dequantize_and_gather_k_cache(out, cache, seq, gl, bt, page, 3)
        dequantize_and_gather_k_cache_ref(out_r, cache, seq, gl, bt, page, 3)
        assert torch.equal(bits(out), bits(out_r))
        assert not torch.isnan(out[0, 3 : L + 3].float()).any()


@pytest.mark.gpu
@pytest.mark.parametrize("record", RECORDS)
def test_gpu_insert_32k_tokens(record, device):
    page, nb, T = 64, 1024, 32768
    buf, cache = make_cache(nb, page, record, device)
    buf_r, cache_r = same_geometry(buf, cache)
    k = random_k(T, device)
    slots = torch.randperm(nb * page, device=device)[:T]
    slots[::97] = -1
    quantize_and_insert_k_cache(k, cache, slots)
    quantize_and_insert_k_cache_ref(k, cache_r, slots)
    assert torch.equal(buf, buf_r)
    live = slots[slots >= 0]
    assert torch.equal(bits(read_slots_ref(cache, live)),
                       bits(quantize_dequantize_ref(k[slots >= 0], record)))
