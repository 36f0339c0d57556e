#!/usr/bin/env bash
# The Gluon Hopper decode on the H200, in one device call (logs under $OUT):
#   perf/run_gluon_decode.sh [tests|bench|quick|few|sweep|ncu|sanitize|heads-tests|heads-bench|heads-sweep ...]
#   (default: tests quick bench ncu sanitize; TESTS_K: a pytest -k filter for tests;
#   T_TESTS / T_BENCH / T_NCU: per-step time limits in seconds; heads-*: the many-heads kernel's
#   tests, bench rows, and its two dequant orders side by side: 8:64:2:1 serial, 8:64:2:2
#   overlapped)
# Run from the repo root (or a stage copy) with PYTHONPATH at it; FlashMLA joins the bench
# when `import flash_mla` works (see third_party/FLASHMLA.txt).
set -u
OUT=${OUT:-/tmp/gluon-out}; mkdir -p "$OUT"
PY=${PY:-python3}
steps=${*:-tests quick bench ncu sanitize}
for s in $steps; do
  case $s in
  tests)
    XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 8"
    timeout -s INT ${T_TESTS:-300} $PY -m pytest tests/attention/test_decode_gluon.py -m gpu -q \
      -p no:cacheprovider $XD -rf ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -60 | tee "$OUT/tests.log" ;;
  few)
    timeout ${T_BENCH:-200} $PY perf/bench_decode_hopper.py --few --csv "$OUT/few.csv" 2>&1 \
      | tee "$OUT/few.log" ;;
  heads-tests)
    XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n ${NPROC:-16}"
    timeout ${HT_TIMEOUT:-300} $PY -m pytest tests/attention/test_decode_gluon_heads.py \
      ${HT_EXTRA:-} -q -p no:cacheprovider $XD -rf 2>&1 | tail -60 | tee "$OUT/heads-tests.log" ;;
  heads-bench)
    timeout ${HB_TIMEOUT:-300} $PY perf/bench_decode_hopper.py --heads --csv "$OUT/heads-bench.csv" \
      2>&1 | tee "$OUT/heads-bench.log" ;;
  heads-sweep)
    timeout ${HS_TIMEOUT:-240} $PY perf/bench_decode_hopper.py --no-table --no-flashmla \
      --sweep "${SWEEP:-8:64:2:1,8:64:2:2}" \
      --sweep-rows "${SWEEP_ROWS:-64,128,584,584;128,128,584,584;64,128,528,288;64,1,584,584;64,32,584,584}" \
      2>&1 | tee "$OUT/heads-sweep.log" ;;
  quick)
    timeout 200 $PY perf/bench_decode_hopper.py --quick 2>&1 | tee "$OUT/quick.log" ;;
  sweep)
    timeout 240 $PY perf/bench_decode_hopper.py --no-table --no-flashmla \
      --sweep "${SWEEP:-4:0:3,8:16:3,8:16:2,8:32:3}" --sweep-rows "${SWEEP_ROWS:-8,128,584,584;8,128,528,288;64,128,584,584;64,128,528,288}" \
      2>&1 | tee "$OUT/sweep.log" ;;
  bench)
    timeout 400 $PY perf/bench_decode_hopper.py --csv "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log" ;;
  ncu)
    NCU_CASES=${NCU_CASES:-"8 128 584 584 4:0:3;8 128 528 288 4:0:3;8 128 584 584 8:16:3"}
    IFS=';' read -ra cases <<< "$NCU_CASES"
    for case in "${cases[@]}"; do
      set -- $case
      echo "== ncu: heads $1 tokens $2 records $3+$4 shape $5" | tee -a "$OUT/ncu.log"
      DSV41_GLUON_SHAPE=$5 timeout ${T_NCU:-120} ncu --clock-control none -k regex:"gluon|heads" \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section InstructionStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        $PY -c "
import torch
from perf.bench_decode_hopper import build_case
from dsv41_triton.attention.decode import sparse_mla_decode
c = build_case($2, $1, $3, $4)
sparse_mla_decode(**c, _kernel='gluon'); torch.cuda.synchronize()" 2>&1 \
        | grep -v "^==PROF==" | tee -a "$OUT/ncu.log" | grep -E "Duration|DRAM Through|Registers|Achieved Occ|Theoretical Occ|Warp Cycles Per Issued|Eligible Warps|Shared Memory Config|Block Limit|Issued Instructions|Issued Warp" ;
    done ;;
  sanitize)
    timeout 240 compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest \
      tests/attention/test_decode_gluon.py -m gpu -q -p no:cacheprovider \
      -k "hostile or empty_rows" 2>&1 | tail -25 | tee "$OUT/sanitize.log" ;;
  esac
done
