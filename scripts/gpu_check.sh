#!/usr/bin/env bash
# The GPU checks, in one call on a lent device machine (prepared here by scripts/gpu_prepare.sh):
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=600)
# 1. the default model is trained in the background (CPU, as `make run` does; too big to carry);
# 2. the CUDA tests: every test file with a CUDA case (greedy MTP on CUDA = CPU without MTP,
#    quantized KV pages on CUDA = CPU, the CUDA prefix-cache arenas, the sampler, the engine-core
#    process, the media towers), their CPU cases alongside;
# 3. `swaserve bench mtp` on the GPU (issue 16's batch-1 target: decode tokens/s >= 1.8x MTP off).
# Results go to $OUT (the device tool brings them back): train.log, tests.log, tests.xml, mtp.log,
# mtp_gpu.json. Each stage has its own limit (TRAIN_S, TEST_S, BENCH_S, seconds), so a hang in
# one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=${GPU_DIR:-.gpu}
OUT=${OUT:-/tmp/gpu-check}
SITE=${SITE:-/tmp/site}
TRAIN_S=${TRAIN_S:-330}
TEST_S=${TEST_S:-240}
BENCH_S=${BENCH_S:-200}
TEST_WORKERS=${TEST_WORKERS:-4}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$GPU_DIR"/whl/*.whl || { echo "gpu_check: installing $GPU_DIR/whl failed (scripts/gpu_prepare.sh)"; exit 2; }
export PYTHONPATH="$SITE:$PWD" SWASERVE_CACHE="${SWASERVE_CACHE:-/tmp/swaserve-cache}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$SWASERVE_CACHE/models" && cp -r "$GPU_DIR"/cache/models/. "$SWASERVE_CACHE/models/"
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
    torch.cuda.get_device_name() if torch.cuda.is_available() else "-", "cores", torch.get_num_threads())'
timeout -k 10 "$TRAIN_S" python3 -c 'from swaserve.model.checkpoint import default_model_dir as d; print(d())' \
    >"$OUT/train.log" 2>&1 &
train=$!
rc=0
timeout -k 10 "$TEST_S" python3 -m pytest -p no:cacheprovider -n "$TEST_WORKERS" --dist loadfile -rs \
    --junitxml "$OUT/tests.xml" \
    tests/engine/test_speculative.py tests/model/test_kv_quant_exact.py tests/engine/test_sampler.py \
    tests/engine/test_prefix_cache_engine.py tests/engine/test_engine_process.py \
    tests/model/test_media_gpu.py tests/engine/test_ep_gpu.py 2>&1 | tee "$OUT/tests.log" || rc=1
if wait "$train"; then
    tail -n 3 "$OUT/train.log"
    timeout -k 10 "$BENCH_S" python3 -c 'from bench.cli import app; app()' mtp \
        --batch 1 --batch 8 --batch 32 --json "$OUT/mtp_gpu.json" 2>&1 | tee "$OUT/mtp.log" || rc=1
else
    echo "gpu_check: training the default model failed or ran past ${TRAIN_S} s (train.log)"
    tail -c 2000 "$OUT/train.log"
    rc=1
fi
echo "gpu_check: rc=$rc"
exit $rc
