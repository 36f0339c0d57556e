#!/usr/bin/env bash
# The Gluon Hopper prefill on the H200, in one device call (logs under $OUT):
#   perf/run_gluon_prefill.sh [tests|bench|ncu|sanitize ...]   (default: tests bench ncu)
# Run from the repo root (or a stage copy) with PYTHONPATH at it; FlashMLA joins the bench
# when `import flash_mla` works (see third_party/FLASHMLA.txt). T_TESTS / T_BENCH / T_NCU:
# per-step time limits in seconds. TESTS_K: a pytest -k filter for the tests step (e.g. the
# warp-specialized kernel alone: "ws and not wsp and not table and not eager and not lazy";
# the persistent one: "wsp");
# BENCH_GLUON_VARIANTS (e.g. eager,ws) for the bench; NCU_VARIANT (e.g. ws) for ncu.
set -u
OUT=${OUT:-/tmp/gluon-prefill-out}; mkdir -p "$OUT"
PY=${PY:-python3}
steps=${*:-tests bench ncu}
for s in $steps; do
  case $s in
  tests)
    XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 8"
    timeout "${T_TESTS:-240}" $PY -m pytest tests/attention/test_prefill_gluon.py -m gpu -q \
      -p no:cacheprovider $XD -rf ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -60 | tee -a "$OUT/tests.log" ;;
  bench)
    timeout "${T_BENCH:-240}" $PY perf/bench_prefill.py --quick --heads "${HEADS:-8,64,128}" \
      2>&1 | tee "$OUT/bench.log" ;;
  ncu)
    for H in ${NCU_HEADS:-64}; do
      echo "== ncu: gluon prefill ${NCU_VARIANT:-table}, heads $H, 4096 x 640" | tee -a "$OUT/ncu.log"
      DSV41_PREFILL_GLUON_VARIANT=${NCU_VARIANT:-} timeout "${T_NCU:-120}" ncu --clock-control none -k regex:gluon --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        $PY -c "
import torch
from perf.bench_prefill import build_kernel_inputs
from dsv41_triton.attention.prefill import sparse_mla_prefill
i = build_kernel_inputs($H)
sparse_mla_prefill(i['q'], i['kv'], i['idx'], None, i['sink'], None, i['out'], _kernel='gluon')
torch.cuda.synchronize()" 2>&1 | grep -v "^==PROF==" | tee -a "$OUT/ncu.log" \
        | grep -E "Duration|Throughput|Registers|Achieved Occ|Warp Cycles Per Issued|Eligible|Stall|Issued Warp" ;
    done ;;
  sanitize)
    timeout "${T_SAN:-240}" compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest \
      tests/attention/test_prefill_gluon.py -m gpu -q -p no:cacheprovider \
      -k "hostile or empty_rows" 2>&1 | tail -25 | tee "$OUT/sanitize.log" ;;
  esac
done
