#!/usr/bin/env bash
# The checks to run when a session is lent a GPU (the `device` tool), in one command, each stage under its own
# time limit so that what finished comes back even when a later stage runs out of time. Run from the project
# root on the GPU machine, with `.whl` carried (../shared/gpu/README.md: `bash ../shared/gpu/fetch-wheels.sh`):
#
#     bash bench/lent_gpu.sh recipe world2 tests     # stages by name, in order; results under $OUT (or ./gpu-out)
#
# Stages:
#   recipe   the users' recipe (issue 37 item 7, issue 40 item 4 in bfloat16, issue 42 item 4 at world 1):
#            HF Llama, TinyLlama-1.1B's shape (bench/configs/llama-1b), float32 master weights, bfloat16 compute,
#            float32 reduce, 2 x 2048 tokens, world 1 on NCCL: FSDP2, FSDP2 + torch.compile, ours ZeRO-3 and
#            ZeRO-2 with the default units, ours ZeRO-3 with int8 gathers
#            (if our rows fail on the HF model, the same shape from the zoo: OUT/recipe-zoo.txt)
#   float32  issue 40 item 4 in float32: the zoo's 542 M-parameter Llama-style model, world 1: FSDP2, FSDP2 +
#            torch.compile, plain thunder.jit, ours ZeRO-3 with the default units
#   world2   issue 42 item 4 at world 2: two gloo ranks on the one GPU, bfloat16 against int8 gathers (gloo
#            copies through the host: bytes and losses hold, times say little)
#   tests    tier 3: tests/test_cuda.py
# Environment: <STAGE>_S each stage's time limit in seconds; RECIPE_ONLY the recipe's rows (bench.gpu --only);
# RECIPE_ZOO=0 skips the zoo's fallback.
# Each stage writes OUT/<stage>.txt (bench.gpu's table, or pytest's output) and OUT/<stage>.log (everything).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/thunder ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .whl/*.whl . \
    || echo "installing .whl failed"
fi
[ -d /tmp/site/thunder ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers, thunder; print('torch', torch.__version__, 'transformers', transformers.__version__,
'thunder', thunder.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tail -1

stage() {  # stage NAME SECONDS COMMAND...: run it under a time limit, log everything, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
}

bench() {  # bench NAME SECONDS ARGS...: a bench.gpu run whose table goes to OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  stage "$name" "$limit" python3 -m bench.gpu --device cuda --out "$OUT/$name.txt" "$@"
  [ -f "$OUT/$name.txt" ] && cat "$OUT/$name.txt" || grep '^\[bench.gpu\]' "$OUT/$name.log" | cut -c1-400
}

for s in "$@"; do
  case "$s" in
    recipe)  bench recipe "${RECIPE_S:-330}" --world 1 --model hf:bench/configs/llama-1b --recipe --seq 2048 \
               --batch 2 --steps 5 --warmup 2 \
               --only "${RECIPE_ONLY:-fsdp2,fsdp2+compile,ours zero3 default,ours zero3 int8,ours zero2 default}"
             if [ "${RECIPE_ZOO:-1}" = 1 ] && ! grep -q '^ours zero3 default  *[0-9]' "$OUT/recipe.txt" 2>/dev/null; then
               # HF failed: the zoo's
               bench recipe-zoo "${RECIPE_S:-330}" --world 1 --layers 22 --d 2048 --heads 32 --hidden 5632 \
                 --vocab 32000 --recipe --seq 2048 --batch 2 --steps 5 --warmup 2 \
                 --only "fsdp2,fsdp2+compile,ours zero3 default,ours zero3 int8,ours zero2 default"
             fi ;;
    float32) bench float32 "${FLOAT32_S:-240}" --world 1 --steps 5 --warmup 2 \
               --only "fsdp2,fsdp2+compile,thunder,ours zero3 default" ;;
    world2)  bench world2 "${WORLD2_S:-200}" --world 2 --layers 4 --d 1024 --hidden 2816 --seq 1024 --recipe \
               --steps 3 --warmup 1 --only "fsdp2,ours zero3 default,ours zero3 int8" ;;
    tests)   stage tests "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
             tail -15 "$OUT/tests.log" | tee "$OUT/tests.txt" ;;
    *) echo "unknown stage $s (recipe, float32, world2, tests)"; exit 2 ;;
  esac
done
