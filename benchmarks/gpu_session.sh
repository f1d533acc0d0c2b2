#!/usr/bin/env bash
# Every CUDA test and GPU benchmark of the project, in stages that each fit one
# 10-minute command on a lent H100/H200, with every result packed into one archive.
#
#   bash benchmarks/gpu_session.sh [STAGE ...]     STAGE: tests bandwidth throughput big queries head pinned noise optimizers adapters
#                                                  peers (= peers-1.3b peers-6.7b peers-13b peers-30b peers-qwen3), or one of those
#                                                  all1 all2 all3: the stages that never ran on a GPU, one device command each
#                                                  (peers-qwen3 alone is a fourth: Qwen3-1.7B and 8B, its own deadline)
#                                                  brief: a 15-minute lease's one command: every CUDA test, then
#                                                  noise, adapters and optimizers at smaller sizes (tests-brief
#                                                  noise-brief adapters-brief optimizers-brief, each a stage too)
#                                                  noise-rounding: the rounding kernels alone (about a minute)
#                                                  profile-qwen3: one profiled step of distzo resident, offload and
#                                                  offload-double at Qwen3-1.7B, their kernels per stream side by side
#                                                  (default: tests bandwidth throughput big)
#
# Results go to $OUT (the device tool's folder; else benchmarks/out/gpu): a log per
# stage and results-<stages>.tgz holding every JSON/Markdown/PNG report, so that a
# single file comes back whatever the number of reports. Each run is bounded by
# `timeout`, so a stuck run costs its own stage and the archive is still written.
# DEADLINE_S (default 540 for all1, all2, all3) bounds the whole command: a run is cut
# to the seconds left before it (30 kept for packing) and skipped when under 30 are
# left, so the archive comes back inside the device tool's 600 s. DRY_RUN=1 prints each
# run's command and limit instead of running it (what a lease would run, at no device time).
# PEERS_ARGS adds flags to every peers.py run (e.g. "--distzo-perturb-scope module").
#
# The machine's image has torch, accelerate, safetensors and pytest but an older
# transformers than setup.cfg asks for: carry the wheel (see benchmarks/README.md,
# "On a lent GPU") in .whl/ and it is put first on PYTHONPATH here. The peers stages
# also want ZO2: a checkout in .peers/zo2 and transformers 4.51's wheels in
# .peers/whl451, installed into /tmp/site451, the ZO2 peer's PYTHONPATH alone; without
# them they measure distzo alone.
set -uo pipefail
PEERS_ARGS=${PEERS_ARGS:-}

OUT=${OUT:-benchmarks/out/gpu}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests bandwidth throughput big)
RUN=()  # the stages to run, the lists expanded
for stage in "${STAGES[@]}"; do  # a typo fails here, not after the stages before it spent device time
    case $stage in
        tests|bandwidth|throughput|big|queries|head|pinned|noise|optimizers|adapters) RUN+=("$stage") ;;
        tests-brief|noise-brief|adapters-brief|optimizers-brief|noise-rounding|profile-qwen3) RUN+=("$stage") ;;
        peers-1.3b|peers-6.7b|peers-13b|peers-30b) RUN+=("$stage") ;;
        peers-qwen3) RUN+=("$stage"); DEADLINE_S=${DEADLINE_S:-540} ;;
        peers) RUN+=(peers-1.3b peers-6.7b peers-13b peers-30b peers-qwen3) ;;
        all1) RUN+=(noise adapters); DEADLINE_S=${DEADLINE_S:-540} ;;
        all2) RUN+=(optimizers peers-1.3b); DEADLINE_S=${DEADLINE_S:-540} ;;
        all3) RUN+=(peers-6.7b peers-13b); DEADLINE_S=${DEADLINE_S:-540} ;;
        brief) RUN+=(tests-brief noise-brief adapters-brief optimizers-brief); DEADLINE_S=${DEADLINE_S:-540} ;;
        *) echo "unknown stage $stage: use tests, bandwidth, throughput, big, queries, head, pinned, noise, optimizers, adapters, peers, peers-1.3b, peers-6.7b, peers-13b, peers-30b, peers-qwen3, all1, all2, all3, brief or one of its stages (tests-brief noise-brief adapters-brief optimizers-brief), noise-rounding, profile-qwen3" >&2; exit 2 ;;
    esac
done
DEADLINE_S=${DEADLINE_S:-}
mkdir -p "$OUT"
WORK=$(mktemp -d)  # after the stage check, so a typo leaves nothing behind; pack removes it

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
git rev-parse --short HEAD 2>/dev/null && git status --short 2>/dev/null | head -20 || true  # the changes HEAD lacks
free -g | head -2 || true

ZO2_ARGS=()  # the ZO2 peer of benchmarks/peers.py, where it was carried
if [[ " ${RUN[*]} " == *" peers-"* ]]; then
    if [ -f .peers/zo2/zo2/optimizer/mezo_sgd/zo2.py ] && compgen -G ".peers/whl451/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site451 \
            .peers/whl451/*.whl && ZO2_ARGS=(--zo2 .peers/zo2 --zo2-python python3 --zo2-pythonpath /tmp/site451)
        PYTHONPATH=/tmp/site451 python3 -c "import transformers; print('ZO2 peer: transformers', transformers.__version__)"
    else
        echo "!! no .peers/zo2 checkout or .peers/whl451 wheels: the peers stages measure distzo alone"
    fi
fi

pack() {
    local name
    name="results-$(IFS=-; echo "${STAGES[*]}").tgz"
    cp "$WORK"/*.log "$OUT"/ 2>/dev/null
    tar czf "$OUT/$name" -C "$WORK" . && echo "packed $OUT/$name"
    rm -rf "$WORK"
}
trap pack EXIT

bounded() {  # bounded SECONDS LOG COMMAND...: one run, its output kept in the stage's log
    local limit=$1 log=$2
    shift 2
    if [ -n "$DEADLINE_S" ]; then  # the command's own limit: keep 30 s for packing
        local left=$((DEADLINE_S - SECONDS - 30))
        if [ "$left" -lt 30 ]; then
            echo "!! skipped, ${DEADLINE_S} s of this command spent: $*" | tee -a "$WORK/$log"
            return 0
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    if [ -n "${DRY_RUN:-}" ]; then
        echo "+ $*  (at most $limit s; dry run)" | tee -a "$WORK/$log"
        return 0
    fi
    echo "+ $*  (at most $limit s)" | tee -a "$WORK/$log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$WORK/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "!! exit $rc: $*" | tee -a "$WORK/$log"
    return 0
}

peers_at() {  # peers_at SHAPE SECONDS [ARGS...]: ZO2's speed tests' point (OPT and Qwen3), batch 1 x 2048 in fp16
    local shape=$1 limit=$2
    shift 2
    bounded "$limit" peers.log python3 benchmarks/peers.py --shape "$shape" --batch 1 --seq 2048 --dtype fp16 \
        --device cuda "${ZO2_ARGS[@]}" "$@" $PEERS_ARGS --out "$WORK/peers-$shape-1x2048-fp16.json"
}

sweep=1x128,2x256,4x512,8x512,16x512
for stage in "${RUN[@]}"; do
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
            --warps 4,8,16,32 --lowrank --out "$WORK/noise.json"
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
    peers-1.3b|peers-6.7b)  # issue 30: ZO2's MeZO and offload against distzo's resident and offload, steps interleaved
        # (six peers at 1.3B: four took 167 s on 2026-11-26, so 330 s for six)
        peers_at "opt-${stage#peers-}" "$([ "$stage" = peers-1.3b ] && echo 330 || echo 340)"
        ;;
    peers-13b|peers-30b)  # two copies do not fit: one system after another, offloads first, 16 timed steps each.
        # distzo-resident's float32 masters of OPT-30B (120 GB) fit no lent GPU.
        # Right after distzo's offload: distzo-offload-half (the masters in fp16, as ZO2 holds its model: the
        # memory target's system, before a deadline can cut it), then the same steps without the block-sized
        # float32 master (distzo-offload-recompute).
        big=zo2-offload,distzo-offload,distzo-offload-half,distzo-offload-recompute,zo2-mezo
        [ "$stage" = peers-13b ] && big=$big,distzo-resident
        [ ${#ZO2_ARGS[@]} -eq 0 ] && big=distzo-offload,distzo-offload-half,distzo-offload-recompute$([ "$stage" = peers-13b ] && echo ,distzo-resident)
        peers_at "opt-${stage#peers-}" 560 --one-at-a-time --warmup 1 --rounds 16 --systems "$big"
        ;;
    peers-qwen3)  # issue 30, Qwen3 where ZO2 supports it: its Qwen3 speed test's point (1 x 2048, fp16) at 1.7B and 8B.
        # At 8B distzo-resident plans 35.7 GB of device memory and zo2-mezo holds 16.4 GB of fp16 weights: the four
        # peers together fill an 80 GB card, so they interleave on a card of 100 GB or more (H200), else they run one
        # at a time, the offloads first, one warm-up and 16 timed steps each (as peers-13b).
        # At 1.7B (the one shape where compute >= transfer) distzo-offload-double stands where
        # distzo-offload-recompute would: the master's upcast and rounding off the compute stream, against the 0.97x target.
        small=zo2-mezo,zo2-offload,distzo-resident,distzo-offload,distzo-offload-double,distzo-offload-half
        [ ${#ZO2_ARGS[@]} -eq 0 ] && small=distzo-resident,distzo-offload,distzo-offload-double,distzo-offload-half
        peers_at qwen3-1.7b 200 --systems "$small"
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
        if [ "${mib:-0}" -ge 100000 ] 2>/dev/null; then
            peers_at qwen3-8b 300
        else
            eight=zo2-offload,distzo-offload,distzo-offload-half,distzo-offload-recompute,zo2-mezo,distzo-resident
            [ ${#ZO2_ARGS[@]} -eq 0 ] && eight=distzo-offload,distzo-offload-half,distzo-offload-recompute,distzo-resident
            peers_at qwen3-8b 300 --one-at-a-time --warmup 1 --rounds 16 --systems "$eight"
        fi
        ;;
    profile-qwen3)  # issue 30's 0.97x-of-resident at Qwen3-1.7B (1 x 2048, fp16, where compute >= transfer): after
        # a few timed steps each, one profiled step of each system: per stream its kernels, its busy time and the part
        # of it beside another stream's kernels (the upcast, the rounding), side by side in
        # profiles-qwen3-1.7b/kernels.md, each step's Chrome trace beside it
        bounded 180 profile.log python3 benchmarks/peers.py --shape qwen3-1.7b --batch 1 --seq 2048 --dtype fp16 \
            --device cuda --systems distzo-resident,distzo-offload,distzo-offload-double --warmup 1 --rounds 4 \
            $PEERS_ARGS --distzo-profile-dir "$WORK/profiles-qwen3-1.7b" --out "$WORK/profile-qwen3-1.7b-1x2048-fp16.json"
        ;;
    tests-brief)  # brief: each CUDA test at most 60 s (where the image has pytest-timeout: the stage's
        # own bound holds without it), the ten slowest named
        per_test=()
        python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)
        bounded 200 tests.log python3 -m pytest -m cuda -q -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} \
            --durations 10 --junitxml "$WORK/cuda-tests.xml"
        ;;
    noise-brief)  # brief: noise.py at 64 M elements (the kernels' tests ran in tests-brief), every kernel
        # also launched with 4 (Triton's default), 8, 16 and 32 warps beside the engine's choice, and
        # LOZO's low-rank noise (its kernels, path lowrank, beside its generic path lowrank-chunked and SPSA's
        # step: the kernels not yet timed on a GPU)
        bounded 100 noise.log python3 benchmarks/noise.py --elements 67108864 --skip-torch --repeats 3 --batch 8 \
            --seq 512 --steps 3 --warps 4,8,16,32 --lowrank --out "$WORK/noise.json"
        ;;
    noise-rounding)  # the stochastic rounding kernels alone (bf16, fp16, fp8; a rebuilt master's write-back) beside
        # the fp16 model's update (what `rounding-fp16` timed by mistake until 2026-11-28), at 4, 8 and 16 warps too
        bounded 90 noise.log python3 benchmarks/noise.py --ops rounding,rounding-fp16,rounding-fp8,rebuild-round,update-fp16 \
            --elements 67108864 --skip-torch --repeats 5 --warps 4,8,16 --out "$WORK/noise-rounding.json"
        ;;
    adapters-brief)  # brief: 4 layers of the Llama-2-7B shape, two points
        bounded 110 adapters.log python3 benchmarks/throughput.py --compare-adapters --shape llama-2-7b --layers 4 \
            --compute-dtype bf16 --sweep 1x64,16x256 --steps 3 --out "$WORK/throughput-llama-2-7b-adapters.json"
        ;;
    optimizers-brief)  # brief: OPT-1.3B offload, SGD vs streamed fp32 momentum and Adam moments at 8 x 512, and
        # --micro-batch-rows 2 (4 micro-batches of 2 rows) against the whole batch: its peak_device_gb
        bounded 125 optimizers.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype bf16 \
            --sweep 8x512 --optimizers sgd,momentum,adam --state-dtype fp32 --micro-batch-rows 2 --steps 3 \
            --skip-resident --out "$WORK/throughput-opt-1.3b-optimizers-fp32.json"
        ;;
    queries)  # optional: n-SPSA's 4 queries (8 passes per upload) at the small points where 1 query is transfer-bound
        bounded 270 queries.log python3 benchmarks/throughput.py --shape opt-1.3b --compute-dtype bf16 \
            --sweep 1x128,2x256,4x512 --num-queries 4 --steps 3 --out "$WORK/throughput-opt-1.3b-bf16-q4.json"
        ;;
    esac
done
