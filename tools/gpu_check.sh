#!/usr/bin/env bash
# Issue 24, part B: quantkit on a GPU, on a lent machine with no network (see /work/.library/device/README.md).
#
#   tools/gpu_check.sh [--dry-run] [--out DIR] [STEP ...]      (default: every step, in the order below)
#   tools/gpu_check.sh --fetch-wheels                            (here, with network: fill .whl/ for the machine)
#
# Steps, each independent (its own time limit; a failure is recorded and the next step runs) and each building
# what it needs, cached under $GPU_CHECK_WORK (default /tmp/gpu_check: kept while the machine stays warm):
#   env            versions, GPU name, nvidia-smi
#   install        carried wheels (.whl/, pip --no-index) into $GPU_CHECK_WORK/site, then quantkit without deps
#   kernels        pytest tests/runtime/kernels WITHOUT TRITON_INTERPRET (junit counts, failing tests)
#   bench_kernels  benchmarks/bench_kernels.py on 7B shapes at M = 1, 4, 16, 64, 256, W4 g128 (and W8 per-channel)
#   parity         engine greedy tokens vs HF generate on a random SmolLM2-135M-shape fp16 model (8 x 32 tokens)
#   decode         a random Llama-2-7B-shape fp16 model, W4 g128 by RTN on the GPU, decode tokens/s at batch
#                  1, 16, 64 against the roofline (copy bandwidth / bytes per decode step)
#   gptq           GPTQ W4 g128 of the 7B-shape model with --device cuda: seconds, peak GPU memory, peak RSS
# Every figure lands in one JSON, $OUT/gpu_check.json ($OUT when set, else --out DIR, default $GPU_CHECK_WORK/result),
# with each step's exit code, seconds and log tail; the logs go to $OUT/gpu_check.log (two files: the device tool
# brings back at most 8). The limits below keep one call under 10 minutes when split, for example, as
#   call 1: env install kernels bench_kernels parity      call 2: install decode      call 3: install gptq
# (install is cheap and needed in every call: a machine given back between calls comes back bare).
#
# --dry-run runs every step on this machine's CPU with tiny shapes (tiny random models, the kernels under
# TRITON_INTERPRET=1 on one test file, bench_kernels skipped without CUDA), to check the script itself.
#
# What the machine lacks (KINDS.md: Python 3.12, torch 2.11, triton 3.6, transformers 5.17, no pydantic): the
# wheels --fetch-wheels downloads into .whl/ (ignored through .git/info/exclude); name .whl in the run's carry.
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
STEPS_ALL=(env install kernels bench_kernels parity decode gptq)
# seconds per step (override one with GPU_CHECK_LIMIT_<STEP>=N; GPU_CHECK_LIMIT_SCALE=N multiplies them all)
declare -A LIMIT=([env]=60 [install]=180 [kernels]=300 [bench_kernels]=240 [parity]=240 [decode]=480 [gptq]=540)
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

DRY=0
OUTDIR=${OUT:-}
STEPS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUTDIR=$2; shift ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) STEPS+=("$1") ;;
  esac
  shift
done

if [ "${FETCH:-0}" = 1 ]; then
  EXCLUDE=$(git -C "$REPO" rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git
  case $EXCLUDE in /*) ;; *) EXCLUDE=$REPO/$EXCLUDE ;; esac
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
  PIP=${PYTHON:-python3}
  exec "$PIP" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$REPO/.whl" "${WHEELS[@]}"
fi

[ ${#STEPS[@]} -eq 0 ] && STEPS=("${STEPS_ALL[@]}")
OUTDIR=${OUTDIR:-$WORK/result}
mkdir -p "$OUTDIR" "$WORK/steps"
STEPDIR=$WORK/steps
rm -f "$STEPDIR"/*  # this call's steps only
if [ -z "${PYTHON:-}" ]; then
  if [ $DRY = 1 ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 QUANTKIT_CACHE=$WORK/cache
SITE=$WORK/site  # the carried wheels, installed by the install step
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
cd "$REPO" || exit 2

if [ $DRY = 1 ]; then
  SMALL=tiny; BIG=tiny; DEVICE=cpu; DTYPE=float32; BATCHES="1 2"; TOKENS=8; PROMPTS=2; CAL="--num-samples 4 --seq-len 64"
  GROUP=32; KERNEL_TESTS=tests/runtime/kernels/test_rmsnorm.py; export TRITON_INTERPRET=1
else
  SMALL=smollm2-135m; BIG=llama2-7b; DEVICE=cuda; DTYPE=float16; BATCHES="1 16 64"; TOKENS=32; PROMPTS=8
  CAL="--num-samples 128 --seq-len 512"; GROUP=128; KERNEL_TESTS=tests/runtime/kernels; unset TRITON_INTERPRET
fi
SMALL_DIR=$WORK/models/$SMALL-small
BIG_DIR=$WORK/models/$BIG-big
W4_DIR=$WORK/out/$BIG-w4-rtn

py() { "$PYTHON" "$@"; }

build_model() {  # preset dir seed
  py tools/random_model.py "$1" "$2" --dtype "$DTYPE" --seed "$3" --shard-mb 2000
}

step_env() { py tools/gpu_check.py env "$STEPDIR/env.json"; }

step_install() {
  if [ $DRY = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then  # built for the machine's Python 3.12
    py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || return 1
  fi
  if [ $DRY = 0 ]; then  # quantkit itself, without its dependencies (PYTHONPATH already reaches the tree)
    py -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "pip -e failed; using PYTHONPATH"
  fi
  py -c "import pydantic, quantkit.cli, quantkit.runtime.engine; print('quantkit imports')"
}

step_kernels() {
  py -m pytest "$KERNEL_TESTS" -q -p no:cacheprovider --junitxml="$WORK/kernels.xml"
  local rc=$?
  py tools/gpu_check.py junit "$WORK/kernels.xml" "$STEPDIR/kernels.json"
  return $rc
}

step_bench_kernels() {
  py benchmarks/bench_kernels.py --models llama7b --batches 1 4 16 64 --prefill 256 --bits 4 --group-size 128 \
    --json "$STEPDIR/bench_kernels.json" || return 1
  [ -f "$STEPDIR/bench_kernels.json" ] || { echo "no CUDA: skipped"; return 0; }
  py benchmarks/bench_kernels.py --models llama7b --kernels matmul --batches 1 4 16 64 --prefill 256 --bits 8 \
    --group-size -1 --json "$STEPDIR/bench_kernels_w8.json" || true
  [ -f "$STEPDIR/bench_kernels_w8.json" ] && py - "$STEPDIR" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1]); main = json.loads((d / "bench_kernels.json").read_text())
main["w8_channel"] = json.loads((d / "bench_kernels_w8.json").read_text()); (d / "bench_kernels_w8.json").unlink()
(d / "bench_kernels.json").write_text(json.dumps(main, indent=1))
EOF
  return 0
}

step_parity() {
  build_model "$SMALL" "$SMALL_DIR" 0 || return 1
  py tools/gpu_check.py parity "$SMALL_DIR" "$STEPDIR/parity.json" --prompts "$PROMPTS" --tokens "$TOKENS"
}

step_decode() {
  build_model "$BIG" "$BIG_DIR" 1 || return 1
  if [ ! -f "$W4_DIR/config.json" ]; then
    py -m quantkit quantize "$BIG_DIR" -o "$W4_DIR" --method rtn --bits 4 --group-size $GROUP --device $DEVICE \
      --force --json "$WORK/w4_rtn.json" || return 1
  fi
  # shellcheck disable=SC2086
  py tools/gpu_check.py decode "$W4_DIR" "$STEPDIR/decode.json" --batches $BATCHES --tokens 64 --prompt-len 64
}

step_gptq() {
  build_model "$BIG" "$BIG_DIR" 1 || return 1
  # shellcheck disable=SC2086
  py -m quantkit quantize "$BIG_DIR" -o "$WORK/out/$BIG-w4-gptq" --method gptq --bits 4 --group-size $GROUP \
    --device $DEVICE $CAL --force --json "$STEPDIR/gptq.json"
}

run_step() {  # name: run step_<name> under its limit, in a subshell; record exit code, seconds and log tail
  local name=$1 limit_var="GPU_CHECK_LIMIT_${1^^}" log=$STEPDIR/$1.log
  local limit=${!limit_var:-$(( ${LIMIT[$name]:-300} * ${GPU_CHECK_LIMIT_SCALE:-1} ))}
  local start rc
  start=$(date +%s.%N)
  echo "== $name (limit ${limit}s)" | tee -a "$OUTDIR/gpu_check.log"
  ( export -f py build_model "step_$name"; timeout --kill-after=15 "$limit" bash -c "step_$name" ) > "$log" 2>&1
  rc=$?
  local seconds
  seconds=$("$PYTHON" -c "import time; print(round(time.time() - $start, 1))")
  tail -c 200000 "$log" >> "$OUTDIR/gpu_check.log"
  "$PYTHON" - "$STEPDIR/$name.status.json" "$name" "$rc" "$seconds" "$limit" "$log" <<'EOF'
import json, sys
path, name, rc, seconds, limit, log = sys.argv[1:]
tail = open(log, errors="replace").read().splitlines()[-25:]
status = {"step": name, "rc": int(rc), "ok": rc == "0", "timed_out": rc in ("124", "137"), "seconds": float(seconds),
          "limit_s": int(limit), "log_tail": tail}
open(path, "w").write(json.dumps(status, indent=1))
EOF
  echo "   $name: rc $rc in ${seconds}s" | tee -a "$OUTDIR/gpu_check.log"
  "$PYTHON" tools/gpu_check.py merge "$STEPDIR" "$OUTDIR/gpu_check.json"  # after every step: a kill keeps the rest
}

export REPO WORK SITE STEPDIR PYTHON DRY DEVICE DTYPE BATCHES TOKENS PROMPTS CAL GROUP KERNEL_TESTS SMALL BIG
export SMALL_DIR BIG_DIR W4_DIR
for name in "${STEPS[@]}"; do
  if [ -z "${LIMIT[$name]:-}" ]; then echo "unknown step '$name'; steps: ${STEPS_ALL[*]}"; exit 2; fi
  run_step "$name"
done
echo "results: $OUTDIR/gpu_check.json"
