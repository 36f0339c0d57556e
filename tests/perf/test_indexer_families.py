"""The opt-in indexer families of the harness (index logits, index top-k): cases only when
named, every implementation checked, a corrupted one caught."""
import torch

from dsv41_triton.perf.cases import INDEXER_FAMILIES, build_cases
from dsv41_triton.perf.impls import Impl, torch_ops_impl, triton_ops_impl
from dsv41_triton.perf.runner import RunConfig, run_benchmark


def _shifted_topk(logits, lens, k, out=None):
    from dsv41_triton.ops.indexer_ref import index_topk_ref

    res = index_topk_ref(logits, lens, k)
    res[0, 0] += 1  # one id off
    if out is not None:
        out.copy_(res)
        return out
    return res


def test_indexer_families_opt_in_and_checked(device):
    default = build_cases("v41-flash", gpu=device == "cuda", quick=True)
    assert not any(c.family in INDEXER_FAMILIES for c in default)
    gpu = device == "cuda"
    cases = build_cases("v41-flash", gpu=gpu, quick=gpu, families=list(INDEXER_FAMILIES))
    assert {c.family for c in cases} == set(INDEXER_FAMILIES)
    if gpu:  # the 1M-position cases are there (run by the benchmark, not here: the timed
        # float64 reference would take a while)
        assert max(c.entries for c in cases) == 1 << 20
        cases = [c for c in cases if c.entries <= 1 << 17]
    bad = Impl("shifted", {"index_topk": _shifted_topk}, "one id off")
    df = run_benchmark(cases, [triton_ops_impl(), torch_ops_impl(), bad], RunConfig(device=device))
    ours = df[df["backend"] != "shifted"]
    assert (ours["status"] == "ok").all(), ours[["case_id", "backend", "status", "note"]]
    assert (df[df["backend"] == "shifted"]["status"] == "FAIL").all()
    assert (ours["gbps"] > 0).all()
    assert (ours[ours["family"] == "index_logits"]["tflops"] > 0).all()
    assert torch.isfinite(torch.tensor(ours["time_us"].to_numpy())).all()
