#!/usr/bin/env bash
# Issue 30: the GPU minutes in one command. Prepared here, run on a lent device machine:
#
#   here:   python bench/gpu_prepare.py          # .gpu/: wheels the image lacks, data subsets, the GGUF in two halves
#   device: call 1 (carry .gpu/whl .gpu/data .gpu/gguf.a .gpu/gguf.sha256):  bash bench/gpu.sh tests
#           call 2 at once, same warm machine (carry .gpu/gguf.b):           bash bench/gpu.sh bench
#   here:   bash bench/gpu.sh --dry-run all       # the plumbing on the CPU, tiny settings (no wheels installed)
#
# Stages: env (device, versions), tests (the suite on the GPU, not the slow tests, junit XML),
# bench (stopping at EOS: greedy vs HF transformers on cuda, lookahead trie/suffix/fixed 15
# in f32 and bf16 (how often bf16 lookahead differs from bf16 greedy), K tokens per device
# call, the overlapped loop on / off, and a jax.profiler trace of one generate call).
# Everything lands in $OUT as gpu-<stage>.tgz.aa, .ab, ... (15 MiB parts) + gpu-<stage>.log
# (the device tool brings back at most 8 files of 16 MiB).
# Each stage is bounded by `timeout` (TESTS_S 300, BENCH_S 420 seconds by default) so both calls
# fit a session's 15 minutes of device time with the machine's start.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STAGE=${1:-all}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/bench/results/gpu-run}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu-work.XXXX)
PY=${PYTHON:-python3}
LOG="$OUT/gpu-$STAGE.log"
exec > >(tee "$LOG") 2>&1
echo "== bench/gpu.sh $STAGE (dry run: $DRY) $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

if [ "$DRY" = 0 ] && [ -d .gpu/whl ]; then  # the packages the device image lacks (built for its Python 3.12)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the repo itself, no install needed
[ -d .gpu/data ] && [ "$DRY" = 0 ] && export LOOKAHEAD_JAX_DATA="$ROOT/.gpu/data"
export LOOKAHEAD_JAX_CACHE=${LOOKAHEAD_JAX_CACHE:-/tmp/lookahead-jax-cache}
[ "$DRY" = 1 ] && unset LOOKAHEAD_JAX_CACHE  # the CPU's own warm cache
export PYTHONUNBUFFERED=1

MODEL=smollm2-135m
if [ -f .gpu/gguf.a ] && [ -f .gpu/gguf.b ]; then  # the GGUF, carried in two halves
  MODEL="$ROOT/.gpu/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$MODEL" ] || cat .gpu/gguf.a .gpu/gguf.b > "$MODEL"
  (cd .gpu && sed "s#  .*#  $MODEL#" gguf.sha256 | sha256sum -c -) || exit 1
fi

if [ "$DRY" = 1 ]; then N=1; NEW=8; TESTS="tests/test_tree.py"; HF="--no-hf"
else N=${N:-4}; NEW=${NEW:-128}; TESTS="tests"; HF="--hf-device cuda"; fi

env_stage() {
  (nvidia-smi || true; $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())"
   $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" || true) 2>&1 | tee "$WORK/env.txt"
}

tests_stage() {
  # the suite on the device's numerics (f32 lossless tests included); the slow tests are
  # CI's, their time is the device's budget. -x off: every failure is worth a line.
  timeout "${TESTS_S:-300}" $PY -m pytest -q -n "${WORKERS:-8}" -m "not slow" -p no:cacheprovider \
    --junitxml "$WORK/tests.xml" $TESTS 2>&1 | tail -60
  echo "pytest exit ${PIPESTATUS[0]}"
}

bench_stage() {
  local T=${BENCH_S:-420} t0=$SECONDS
  left() { echo $(( T - (SECONDS - t0) )); }
  # greedy vs HF on cuda, lookahead: the trie (auto, fixed 15) and the suffix drafter, f32
  timeout "$(left)" $PY bench/lookahead.py --model "$MODEL" --datasets nq humaneval gsm8k --n "$N" \
    --max-new-tokens "$NEW" $HF --configs auto 15:12:hierarchical suffix:auto --out "$WORK/lookahead-f32.json"
  # bf16: how often lookahead's output differs from bf16 greedy's (identical_to_greedy)
  [ "$(left)" -gt 60 ] && timeout "$(left)" $PY bench/lookahead.py --model "$MODEL" --dtype bfloat16 \
    --datasets nq humaneval gsm8k --n "$N" --max-new-tokens "$NEW" --no-hf --configs auto suffix:auto \
    --out "$WORK/lookahead-bf16.json"
  # K tokens per device call (the decode loop as one lax.while_loop)
  [ "$(left)" -gt 60 ] && timeout "$(left)" $PY bench/device_steps.py --model "$MODEL" --n "$N" \
    --max-new-tokens "$NEW" --ks 1 8 32 --out "$WORK/device-steps.json"
  # a profiler trace of one generate call (greedy then lookahead, warm)
  [ "$(left)" -gt 30 ] && timeout "$(left)" $PY - "$MODEL" "$WORK/trace" "$NEW" <<'EOF'
import sys, jax, lookahead_jax as lj
model, tok = lj.load(sys.argv[1])
ids = tok.encode("def fibonacci(n):")
for s in ("greedy", "lookahead"):
    lj.generate(model, tok, [ids], max_new_tokens=int(sys.argv[3]), strategy=s)  # compile
with jax.profiler.trace(sys.argv[2]):
    for s in ("greedy", "lookahead"):
        out = lj.generate(model, tok, [ids], max_new_tokens=int(sys.argv[3]), strategy=s)
        print(s, out.stats["tokens_per_s"], "tok/s", out.stats["forward_steps"], "steps")
EOF
  # the overlapped loop (budget scoring and the drafter's store update during the next
  # forward) against the plain one, where a step is short enough for host work to show
  [ "$(left)" -gt 60 ] && timeout "$(left)" $PY bench/overlap.py --model "$MODEL" --batches 1,8 \
    --rounds "${ROUNDS:-3}" --tokens "$NEW" --out "$WORK/overlap.json"
}

case "$STAGE" in
  env) env_stage ;;
  tests) env_stage; tests_stage ;;
  bench) env_stage; bench_stage ;;
  all) env_stage; tests_stage; bench_stage ;;
  *) echo "usage: bash bench/gpu.sh [--dry-run] [env|tests|bench|all]"; exit 2 ;;
esac
# one archive, cut into 15 MiB parts (the device tool brings back files of at most 16 MiB):
# here, `cat gpu-<stage>.tgz.* | tar xz`
rm -f "$OUT/gpu-$STAGE.tgz."*
tar czf - -C "$WORK" . | split -b 15m - "$OUT/gpu-$STAGE.tgz." && echo "results: $(ls "$OUT/gpu-$STAGE.tgz."* | xargs -n1 basename | tr '\n' ' ')"
