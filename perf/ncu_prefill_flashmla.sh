#!/usr/bin/env bash
# ncu of FlashMLA's sm_90 sparse prefill (`flash_mla_sparse_fwd`, heads zero-padded to 64) on
# the issue's shape (4096 tokens x 640 keys of a 32768-row bf16 workspace), at 8 and 64 heads,
# one launch each, beside nothing else: the launches are picked by an NVTX range. Needs
# `import flash_mla` to work (PYTHONPATH at a local build); run from the repo root on the device.
set -u
ncu --clock-control none --nvtx --nvtx-include "flashmla/" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis_Tables \
  --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_pipe_tensor.sum \
  ${PY:-python3} - <<'PYEOF' 2>&1 | grep -v "^==PROF=="
import sys
import torch
sys.path.insert(0, "perf")
import bench_prefill as bp
for H in (8, 64):
    inp = bp.build_kernel_inputs(H)
    fn = bp._flashmla_fn(inp)
    if fn is None:
        sys.exit("flash_mla is not importable")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("flashmla")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"flashmla H={H} launched", flush=True)
PYEOF
