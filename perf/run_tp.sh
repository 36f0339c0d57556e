#!/usr/bin/env bash
# TP=1/2/4 runs of the V4.1 attention layer under torchrun (perf/tp_run.py) for the GPUs
# present: each run checks TP=N against an in-process TP=1 layer and times the prefill and
# decode steps; a short table of every run comes last.
#
#   bash perf/run_tp.sh [extra tp_run.py args, e.g. --preset v4-pro --steps 8]
#
# BACKEND (default triton) picks the attention backend; TP_SIZES overrides "1 2 4".
# Without a GPU it runs the tiny preset on the CPU (gloo, torch backend) as a smoke test.
# Logs and tp.jsonl go to $OUT (the device tool's output folder) or ./bench-out.
set -u
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-bench-out}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
JSONL="$OUTDIR/tp.jsonl"
rm -f "$JSONL"

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${NGPU:-0}
if [ "$NGPU" -gt 0 ]; then
    BACKEND=${BACKEND:-triton}
    DEV_ARGS=(--device cuda --backend "$BACKEND")
    MAXTP=$NGPU
    echo "== $NGPU GPU(s)"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
else
    BACKEND=${BACKEND:-torch}
    DEV_ARGS=(--device cpu --backend "$BACKEND" --preset tiny)
    MAXTP=2
    echo "== no GPU: tiny preset on the CPU (gloo)"
fi
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

rc=0
for tp in ${TP_SIZES:-1 2 4}; do
    if [ "$tp" -gt "$MAXTP" ]; then
        echo "== TP=$tp: skipped ($MAXTP device(s))"
        continue
    fi
    echo "== TP=$tp"
    t0=$(date +%s)
    $PY -m torch.distributed.run --standalone --nproc-per-node "$tp" perf/tp_run.py --tp "$tp" \
        "${DEV_ARGS[@]}" --jsonl "$JSONL" "$@" > "$OUTDIR/tp$tp.log" 2>&1
    r=$?
    grep -E '^tp=' "$OUTDIR/tp$tp.log" || tail -n 30 "$OUTDIR/tp$tp.log"
    echo "TP=$tp rc=$r in $(( $(date +%s) - t0 )) s"
    [ "$r" -ne 0 ] && rc=1
done

echo "== summary (median ms per step; tp1-reference rows: rank 0's in-process TP=1 layer)"
$PY - "$JSONL" <<'PYEOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError as e:
    print("no results:", e); sys.exit(0)
cols = ["tp", "world", "role", "layer_id", "ratio", "phase", "tokens", "heads", "backend",
        "median_ms", "min_ms", "max_rel_err", "ok"]
def cell(v):
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
rows.sort(key=lambda r: (r["layer_id"], r["phase"] != "prefill", r["world"], r["tp"]))
cells = [[cell(r.get(c)) for c in cols] for r in rows]
w = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
print("  ".join(c.rjust(w[i]) for i, c in enumerate(cols)))
for x in cells:
    print("  ".join(v.rjust(w[i]) for i, v in enumerate(x)))
PYEOF
exit $rc
