#!/usr/bin/env bash
# The scale-out GPU check, one run on one GPU: bf16 training of Medusa and DFlash drafters for a ~1.2B random
# Llama target (hidden 2048, 16 layers, GQA 32/8 heads, MLP 8192), every job of bench_training.py in one process
# (online vs offline target states), then Medusa stage 2 under FSDP2 and DeepSpeed ZeRO-2/3 and online DFlash
# under FSDP2, through the shipped launch configs (one process: what a single GPU allows), in under 9 minutes.
# Prints tokens/s, TFLOP/s and MFU against the matrix rate measured on the same GPU. Logs and RESULTS lines go to $OUT (default /tmp/gpu_check).
#
#   bash tests/benchmarks/gpu_check.sh
#   MODEL="model=tiny" STEPS=4 bash tests/benchmarks/gpu_check.sh     # a dry run of the script itself
#   JOBS=dflash,dflash_online RUNS=fsdp:dflash_online bash tests/benchmarks/gpu_check.sh   # some jobs only
#
# Wheels the machine lacks may be carried in .whl/ (installed to /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export DRAFTHEADS_CACHE=${DRAFTHEADS_CACHE:-/tmp/dhcache} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-"model=tiny model.tiny.hidden_size=2048 model.tiny.num_hidden_layers=16 model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.intermediate_size=8192 model.tiny.vocab_size=32000 model.dtype=bfloat16"}
# DFlash with dense SDPA attention: FlopCounterMode cannot see inside compiled flex_attention
ARGS="$MODEL steps=${STEPS:-12} data.max_length=1024 trainer.batch_size=16 dflash.attention=sdpa"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"

bench() {  # label, timeout, command...
  local label=$1 limit=$2; shift 2
  echo "== $label"
  timeout "$limit" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -E "^(device|job |ROW|FAILED|offline cache)" "$OUT/$label.log" || true
  [ $rc -eq 0 ] || { echo "$label failed (rc $rc):"; grep -E "Error|error" "$OUT/$label.log" | tail -5; }
}

bench single 240 python3 tests/benchmarks/bench_training.py $ARGS ${JOBS:+jobs=$JOBS}
for run in ${RUNS:-fsdp:stage2 deepspeed_zero2:stage2 deepspeed_zero3:stage2 fsdp:dflash_online}; do
  engine=${run%:*} job=${run#*:}
  bench "$engine-$job" 60 python3 -m accelerate.commands.launch --config_file "launch/$engine.yaml" --num_processes 1 \
    tests/benchmarks/bench_training.py $ARGS jobs=$job
done
