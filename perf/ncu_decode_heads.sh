#!/usr/bin/env bash
# ncu of one many-heads Gluon decode launch with the stall-reason breakdown (run on the device
# from the repo root or a stage copy, PYTHONPATH at it): perf/ncu_decode_heads.sh [H T A B]
# DSV41_GLUON_SHAPE picks the variant (default 8:64:2; 8:64:2:1 serial, 8:64:2:2 overlapped,
# 8:64:2:3 the warp-specialized kernel of decode_heads_ws.py)
set -u
H=${1:-64}; T=${2:-128}; A=${3:-584}; B=${4:-584}
DSV41_GLUON_SHAPE=${DSV41_GLUON_SHAPE:-8:64:2} ncu --clock-control none -k regex:heads --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
  ${PY:-python3} -c "
import torch
from perf.bench_decode_hopper import build_case
from dsv41_triton.attention.decode import sparse_mla_decode
c = build_case($T, $H, $A, $B)
sparse_mla_decode(**c, _kernel='gluon'); torch.cuda.synchronize()" 2>&1 | grep -v "^==PROF=="
