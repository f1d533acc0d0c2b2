#!/usr/bin/env bash
# Every CUDA test and GPU benchmark of the project, in stages that each fit one
# 10-minute command on a lent H100/H200, with every result packed into one archive.
#
#   bash benchmarks/gpu_session.sh [STAGE ...]     STAGE: tests bandwidth throughput big queries head pinned noise optimizers adapters
#                                                  (default: the first four)
#
# Results go to $OUT (the device tool's folder; else benchmarks/out/gpu): a log per
# stage and results-<stages>.tgz holding every JSON/Markdown/PNG report, so that a
# single file comes back whatever the number of reports. Each run is bounded by
# `timeout`, so a stuck run costs its own stage and the archive is still written.
#
# The machine's image has torch, accelerate, safetensors and pytest but an older
# transformers than setup.cfg asks for: carry the wheel (see benchmarks/README.md,
# "On a lent GPU") in .whl/ and it is put first on PYTHONPATH here.
set -uo pipefail

OUT=${OUT:-benchmarks/out/gpu}
WORK=$(mktemp -d)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests bandwidth throughput big)
for stage in "${STAGES[@]}"; do  # a typo fails here, not after the stages before it spent device time
    case $stage in
        tests|bandwidth|throughput|big|queries|head|pinned|noise|optimizers|adapters) ;;
        *) echo "unknown stage $stage: use tests, bandwidth, throughput, big, queries, head, pinned, noise, optimizers or adapters" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
git rev-parse --short HEAD 2>/dev/null || true

pack() {
    local name
    name="results-$(IFS=-; echo "${STAGES[*]}").tgz"
    tar czf "$OUT/$name" -C "$WORK" . && echo "packed $OUT/$name"
}
trap pack EXIT

bounded() {  # bounded SECONDS LOG COMMAND...: one run, its output kept in the stage's log
    local limit=$1 log=$2
    shift 2
    echo "+ $*" | tee -a "$WORK/$log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$WORK/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "!! exit $rc: $*" | tee -a "$WORK/$log"
    return 0
}

sweep=1x128,2x256,4x512,8x512,16x512
for stage in "${STAGES[@]}"; do
    case $stage in
    tests)
        bounded 500 tests.log python3 -m pytest -m cuda -q -p no:cacheprovider --junitxml "$WORK/cuda-tests.xml"
        ;;
    bandwidth)
        bounded 360 bandwidth.log python3 benchmarks/bandwidth.py --dtypes fp32,bf16,fp8 --repeats 10 \
            --out "$WORK/bandwidth.json"
        for shape in opt-13b opt-175b; do
            bounded 60 bandwidth.log python3 benchmarks/model.py --bandwidth "$WORK/bandwidth.json" --shape $shape \
                --out "$WORK/model-$shape.md"
        done
        ;;
    throughput)  # OPT-1.3B, fp32 and bf16 compute: the crossover sweep, resident vs offload
        for dtype in fp32 bf16; do
            bounded 270 throughput.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype $dtype \
                --sweep $sweep --steps 3 --out "$WORK/throughput-opt-1.3b-$dtype.json"
        done
        ;;
    big)  # OPT-6.7B: fits an H100 whole in bf16 and fp32, so resident is measurable
        for dtype in bf16 fp32; do
            bounded 280 big.log python3 benchmarks/throughput.py --shape opt-6.7b --compute-dtype $dtype \
                --sweep 1x256,4x512,8x512 --steps 3 --out "$WORK/throughput-opt-6.7b-$dtype.json"
        done
        ;;
    head)  # the LM head at label positions vs the full head, SmolLM2-135M shape, SST-2-shaped batch
        for dtype in fp32 bf16; do
            bounded 150 head.log python3 benchmarks/throughput.py --compare-head --compute-dtype $dtype --steps 10 \
                --out "$WORK/head-smollm2-$dtype.json"
        done
        ;;
    pinned)  # what the host copy of OPT-13B locks, exactly pinned vs the caching allocator
        bounded 240 pinned.log python3 benchmarks/pinned.py --shape opt-13b --out "$WORK/pinned-opt-13b.json"
        ;;
    noise)  # the fused noise kernels against the legacy path (256 M elements), and the opt-125m 4-layer step.
        # The tests hold each kernel to the CPU path bit for bit (update, momentum, Adam, bf16/fp16/fp8
        # rounding; perturb within an ulp); the benchmark times each op (window: a recomputed momentum's
        # 32 terms in one pass; momentum/adam: the stored moments) as GB/s and as a fraction of a copy.
        bounded 180 noise.log python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py -k noise
        bounded 400 noise.log python3 benchmarks/noise.py --elements 268435456 --skip-torch --batch 8 --seq 512 \
            --out "$WORK/noise.json"
        ;;
    optimizers)  # issue 15: --grad-accum's peak device memory, and streamed Adam/momentum moments (fp32, bf16) vs SGD
        bounded 270 optimizers.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype bf16 --batch 16 \
            --seq 512 --grad-accum 1,2,4 --steps 3 --skip-resident --out "$WORK/throughput-opt-1.3b-accum.json"
        for state in fp32 bf16; do
            bounded 200 optimizers.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype bf16 \
                --sweep 1x128,8x512 --optimizers sgd,momentum,adam --state-dtype $state --steps 3 --skip-resident \
                --out "$WORK/throughput-opt-1.3b-optimizers-$state.json"
        done
        ;;
    adapters)  # issue 14: full vs LoRA-FA vs the dual forward and batched queries at q=4 (P-RGE: Llama2-7B, seq 64, batch 1)
        bounded 400 adapters.log python3 benchmarks/throughput.py --compare-adapters --shape llama-2-7b --layers 8 \
            --compute-dtype bf16 --sweep 1x64,8x64,16x256 --steps 5 --out "$WORK/throughput-llama-2-7b-adapters.json"
        ;;
    queries)  # optional: n-SPSA's 4 queries (8 passes per upload) at the small points where 1 query is transfer-bound
        bounded 270 queries.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype bf16 \
            --sweep 1x128,2x256,4x512 --num-queries 4 --steps 3 --out "$WORK/throughput-opt-1.3b-bf16-q4.json"
        ;;
    esac
done
cp "$WORK"/*.log "$OUT"/ 2>/dev/null || true
