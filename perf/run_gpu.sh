#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the whole test suite on the GPU (GPU-marked tests
# included), the comparison harness (default preset, or the one given), and a short table last.
#
#   bash perf/run_gpu.sh [--quick] [extra dsv41-bench args...]
#
# PARTS (default "tests harness decode prefill"; "sanitize" adds compute-sanitizer memcheck
# of the Gluon kernels' hostile-id, empty-row and edge tests, SAN_SKIP=n skipping its first n
# groups; "few" the few-heads prefill probe
# and its ncu pass; "paged" the paged prefill with window rows: its GPU tests, then the 8-head
# kernel rows and the layer's memory table, each step time-bounded so the part fits a 600 s
# call; "persist" the few-heads decode on its per-token and persistent grids at decode batch
# sizes; "ds" the record kernel's dequant + S form: its GPU tests and the top-k probe beside
# the record kernel; "dslayer" the layer chunk at 8K with it off and on, and its memcheck;
# "dsf16" the form with fp16 operands: the probe beside the record kernel with its tiles freed
# in two parts and the slot ids one / two blocks ahead, their GPU tests, the layer chunk at 8K,
# memcheck)
# picks the parts to run and
# TESTS_K narrows the GPU tests to a pytest -k expression, so a short device call can run only
# what changed, e.g.
#   PARTS="tests prefill" TESTS_K=wsp BENCH_GLUON_VARIANTS=ws,wsp bash perf/run_gpu.sh
#
# Writes logs and the report to $OUT (the device tool's output folder) or ./bench-out.
# FlashMLA joins the comparison when `import flash_mla` works (e.g. PYTHONPATH pointing at a
# local build); nothing here builds it.
set -u
OUTDIR=${OUT:-bench-out}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
$PY -c "import flash_mla; print('flash_mla: importable')" 2>/dev/null || echo "flash_mla: not importable (FlashMLA rows will say so)"

PARTS=${PARTS:-tests harness decode prefill}
part() { case " $PARTS " in *" $1 "*) return 0 ;; *) echo "(skipped: not in PARTS)"; return 1 ;; esac; }
# the layer chunk at 8K with the paged prefill's top-k form FORM (bench_prefill --few-ds) and
# more bench_prefill arguments: LABEL FORM [ARGS...]
layer_8k() {
  local label=$1 form=$2 tag
  shift 2
  tag=$(echo "$form $*" | tr -d ' -')
  timeout 120 $PY perf/bench_prefill.py --layer-only --contexts 8192 --few-ds "$form" "$@" \
    > "$OUTDIR/${label}_layer_$tag.log" 2>&1
  grep -E "graph" "$OUTDIR/${label}_layer_$tag.log" | grep -E "paged-window |workspace |auto" \
    | sort -u | sed "s/^/ds=$form $* /"
}
# compute-sanitizer memcheck of test_decode_gluon.py tests: LABEL KEXPR
gluon_memcheck() {
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 $PY -m pytest \
    tests/attention/test_decode_gluon.py -q -p no:cacheprovider -k "$2" > "$OUTDIR/$1_sanitize.log" 2>&1
  echo "$1 memcheck rc=$?: $(grep -E 'passed|failed' "$OUTDIR/$1_sanitize.log" | tail -1)," \
    "$(grep 'ERROR SUMMARY' "$OUTDIR/$1_sanitize.log" | head -1)"
}
test_rc=0
bench_rc=0

echo "== tests (GPU)"
if part tests; then
  t0=$(date +%s)
  XDIST=""
  $PY -c "import xdist" 2>/dev/null && XDIST="-n ${PYTEST_WORKERS:-8}"
  $PY -m pytest tests -q $XDIST -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
    > "$OUTDIR/pytest_gpu.log" 2>&1
  test_rc=$?
  tail -n 25 "$OUTDIR/pytest_gpu.log"
  echo "tests rc=$test_rc in $(( $(date +%s) - t0 )) s"
fi

echo "== harness"
if part harness; then
  t0=$(date +%s)
  $PY -m dsv41_triton.perf --out "$OUTDIR/bench" "$@" > "$OUTDIR/bench.log" 2>&1
  bench_rc=$?
  tail -n 5 "$OUTDIR/bench.log"
  echo "harness rc=$bench_rc in $(( $(date +%s) - t0 )) s"
fi

echo "== Hopper decode (tl vs the Gluon kernels vs FlashMLA's kernel, issue 10's table)"
if ! part decode; then
  :
elif $PY -c "import torch,sys; sys.exit(torch.cuda.get_device_capability() != (9, 0))" 2>/dev/null; then
  $PY perf/bench_decode_hopper.py --csv "$OUTDIR/decode_hopper.csv" > "$OUTDIR/decode_hopper.log" 2>&1
  tail -n 16 "$OUTDIR/decode_hopper.log"
  # launch shapes beside the picked ones: the warp-specialized kernels' producer with its
  # slot ids preloaded 8 blocks at a time (5th field 0), the few-heads dequant partition's
  # group prefetch (6th field p), both, and the one-stage kernel picked at 8 h 528+288 T > 128
  $PY perf/bench_decode_hopper.py --no-table --reps 20 \
    --sweep "4:8:2:w,4:8:2:w:0,4:8:2:w:1:p,4:8:2:w:0:p,4:0:1:h,4:16:2:w,4:16:2:w:0,4:16:2:w:1:p,8:64:2,8:64:2:3,8:64:2:3:0" \
    --sweep-rows "8,128,584,584;8,128,528,288;8,512,584,584;8,512,528,288;16,128,584,584;64,128,584,584;128,128,584,584;64,128,528,288" \
    > "$OUTDIR/decode_hopper_sweep.log" 2>&1
  grep "^| [0-9]" "$OUTDIR/decode_hopper_sweep.log"
  # the gather alone (no dequant, no products): the few-heads decode's access pattern
  $PY perf/gather_probe.py --tokens 128,1024 --split 1,2 --ctas-per-sm 2 --stages 2 \
    --modes tile64,row,tile64_pre,row_pre > "$OUTDIR/gather_probe.log" 2>&1
  grep "^| [0-9]" "$OUTDIR/gather_probe.log"
else
  echo "not an sm_90 GPU: skipped"
fi

echo "== few-heads prefill (Gluon few / window kernels: check against tl, times, ncu)"
if part few; then
  timeout ${T_FEW:-300} $PY perf/prefill_few_probe.py > "$OUTDIR/prefill_few.log" 2>&1
  tail -n 30 "$OUTDIR/prefill_few.log"
  timeout ${T_NCU:-240} bash perf/ncu_prefill_few.sh > "$OUTDIR/ncu_prefill_few.log" 2>&1
  grep -E "few|window|Duration|Throughput|bank_conflicts|pipe_tensor|Warp Cycles Per Issued|stalled_(long|short|barrier|mio|math|wait|tex|lg)" \
    "$OUTDIR/ncu_prefill_few.log" | head -80
fi

echo "== paged prefill with window rows: GPU tests, 8-head rows, layer table"
if part paged; then
  timeout ${T_PAGED_TESTS:-240} $PY -m pytest tests/attention/test_prefill_shared.py tests/layers/test_layer.py \
    tests/attention/test_decode_gluon.py tests/attention/test_prefill_gluon.py -m gpu -q \
    -p no:cacheprovider $($PY -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}") \
    -k "paged or shared or (gpu_multistep and triton) or few_ws_persistent or (prefill_gluon and (few or table))" \
    > "$OUTDIR/pytest_paged.log" 2>&1
  echo "paged tests rc=$?"; tail -n 8 "$OUTDIR/pytest_paged.log"
  # the paged prefill's index ops on the GPU (their tests take the GPU when there is one)
  timeout 60 $PY -m pytest tests/ops/test_prefill_indices.py tests/ops/test_codecs.py -q -p no:cacheprovider \
    > "$OUTDIR/pytest_prefill_indices.log" 2>&1
  echo "index op tests rc=$?"; tail -n 3 "$OUTDIR/pytest_prefill_indices.log"
  BENCH_GLUON_VARIANTS=few timeout ${T_PAGED:-270} $PY perf/bench_prefill.py --heads 8 \
    > "$OUTDIR/prefill_paged.log" 2>&1
  # (the rows as they were printed, when the time bound cut the summary off)
  grep -q summary "$OUTDIR/prefill_paged.log" && sed -n '/summary/,$p' "$OUTDIR/prefill_paged.log" \
    | head -40 || tail -n 40 "$OUTDIR/prefill_paged.log"
fi

echo "== the few-heads decode on its per-token (w) and persistent (W) grids at decode batch sizes"
if part persist; then
  timeout 200 $PY perf/bench_decode_hopper.py --no-table --reps 20 \
    --sweep "4:8:2:w:0:p,4:8:2:W:0:p,4:16:2:w:0:p,4:16:2:W:0:p,4:8:2:w,4:8:2:W" \
    --sweep-rows "8,128,584,584;8,512,584,584;8,2048,584,584;16,512,584,584;8,512,528,288" \
    > "$OUTDIR/decode_persist_sweep.log" 2>&1
  grep "^| [0-9]" "$OUTDIR/decode_persist_sweep.log"
fi

echo "== the record kernel's dequant + S form (decode_few_ds.py, launch.FEW_DS): checks, then timed"
if part ds; then
  timeout 200 $PY -m pytest tests/attention/test_decode_gluon.py tests/attention/test_prefill_shared.py \
    -q -p no:cacheprovider -k "few_ds" > "$OUTDIR/ds_tests.log" 2>&1
  echo "ds tests rc=$?: $(tail -n 1 "$OUTDIR/ds_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUTDIR/ds_tests.log" | head -10
  timeout 120 $PY perf/paged_topk_probe.py --tokens 2048,4096 --check \
    --rows "decode,decode ds,decode ds no reads,prefill few" > "$OUTDIR/ds_probe.log" 2>&1
  cat "$OUTDIR/ds_probe.log"
fi
echo "== the dequant + S form in the layer chunk (8K, off / on) and under memcheck"
if part dslayer; then
  layer_8k ds 0
  layer_8k ds 1
  gluon_memcheck ds "few_ds_gpu and (-5- or -300-) and 584-584"
fi

echo "== the dequant + S form with fp16 operands (decode_few_ds F16, launch.FEW_DS_F16)"
if part dsf16; then
  timeout 150 $PY perf/paged_topk_probe.py --tokens 2048 --check \
    --rows "decode,decode ds f16,decode ds f16 split4,decode ds f16 split4 ahead2" \
    > "$OUTDIR/dsf16_probe.log" 2>&1
  grep -v "^$" "$OUTDIR/dsf16_probe.log" | tail -12
  timeout 200 $PY -m pytest tests/attention/test_decode_gluon.py -q -p no:cacheprovider \
    -k "few_ds_f16_gpu and (4-2-584 or 4-2-528 or 4-1-584-584 or 4-1-528)" \
    > "$OUTDIR/dsf16_tests.log" 2>&1
  echo "dsf16 tests rc=$?: $(tail -n 1 "$OUTDIR/dsf16_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUTDIR/dsf16_tests.log" | head -10
  layer_8k dsf16 f16 --ds-split 4 --ds-ahead 1
  layer_8k dsf16 f16 --ds-split 4 --ds-ahead 2
  gluon_memcheck dsf16 "few_ds_f16_gpu and 4-2-584 and (-8-5 or -8-300)"
fi

echo "== Hopper prefill (tl vs Gluon vs FlashMLA's flash_mla_sparse_fwd, issue 11's table)"
if ! part prefill; then
  :
elif $PY -c "import torch,sys; sys.exit(torch.cuda.get_device_capability() != (9, 0))" 2>/dev/null; then
  BENCH_GLUON_VARIANTS=${BENCH_GLUON_VARIANTS:-eager,ws,wsp} $PY perf/bench_prefill.py --quick \
    > "$OUTDIR/prefill_hopper.log" 2>&1
  sed -n '/summary/,$p' "$OUTDIR/prefill_hopper.log" | head -16
else
  echo "not an sm_90 GPU: skipped"
fi

echo "== compute-sanitizer memcheck (Gluon decode / prefill: hostile ids, empty rows, edges)"
san_rc=0
if part sanitize; then
  # Under memcheck the memory each test allocates stays allocated until its process exits
  # (measured on the H200, torch 2.11: ~1 GiB per few-heads edge test, ~11 GiB per T = 512
  # one; without the sanitizer the same tests end at 0.03 GiB), so each group runs in its own
  # process, small enough for the GPU (the shared-window V4.1 tests ran out of an H100's 80 GB
  # as one group).
  for grp in "test_decode_gluon.py|gpu and (hostile or empty_rows or wide_ids) and not f16" \
             "test_decode_gluon.py|few_ws_edges and not -512-" \
             "test_decode_gluon.py|few_ws_edges and 584-584-512" \
             "test_decode_gluon.py|few_ws_edges and 528-288-512" \
             "test_decode_gluon.py|few_ws_persistent and 300 and (584-584 or 528-288)" \
             "test_decode_gluon_heads.py|gpu and (hostile or empty_rows)" \
             "test_prefill_gluon.py|gpu and (hostile or empty_rows or two_ctas)" \
             "test_prefill_shared.py|empty_rows or (v41 and not paged_topk)" \
             "test_prefill_shared.py|paged_topk_v41 and 584" \
             "test_prefill_shared.py|paged_topk_v41 and 528" \
             "test_prefill_shared.py|paged_topk_v41 and 288"; do
    f=${grp%%|*}; k=${grp#*|}
    if [ "${SAN_SKIP:-0}" -gt 0 ]; then SAN_SKIP=$(( SAN_SKIP - 1 )); continue; fi
    compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 $PY -m pytest \
      "tests/attention/$f" -q -p no:cacheprovider -k "$k" > "$OUTDIR/sanitize.log.tmp" 2>&1
    rc=$?
    cat "$OUTDIR/sanitize.log.tmp" >> "$OUTDIR/sanitize.log"
    echo "$f [$k]: rc=$rc, $(grep -E 'passed|failed' "$OUTDIR/sanitize.log.tmp" | tail -1)," \
      "$(grep 'ERROR SUMMARY' "$OUTDIR/sanitize.log.tmp" | head -1)"
    [ $rc -ne 0 ] && san_rc=$rc
  done
  rm -f "$OUTDIR/sanitize.log.tmp"
fi

echo "== summary"
$PY - "$OUTDIR/bench/results.csv" <<'PYEOF'
import sys
try:
    import pandas as pd
    df = pd.read_csv(sys.argv[1])
except Exception as e:  # the harness failed before writing
    print("no results:", e); sys.exit(0)
cols = [c for c in ("family", "heads", "tokens", "records", "layout", "backend", "status", "time_us", "tflops", "gbps", "pct_roof", "out_rel_err") if c in df.columns]
pd.set_option("display.width", 200); pd.set_option("display.max_rows", 400)
print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
PYEOF
exit $(( test_rc != 0 || bench_rc != 0 || san_rc != 0 ))
