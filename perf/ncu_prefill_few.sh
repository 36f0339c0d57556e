#!/usr/bin/env bash
# ncu of the few-heads Gluon prefill kernels at the issue's 8-head shape (4096 tokens x 512
# top-k keys; the wgmma kernel, the two-mma.sync-consumer kernel, the window kernel), one launch
# each, with shared-memory bank conflicts and the stall-reason breakdown (run on the device from
# the repo root, PYTHONPATH at it): perf/ncu_prefill_few.sh
set -u
ncu --clock-control none -k regex:"few|window" --launch-count 3 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis_Tables \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_pipe_tensor.sum \
  ${PY:-python3} perf/prefill_few_probe.py --ncu 2>&1 | grep -v "^==PROF=="
