#!/usr/bin/env bash
# The GPU checks of issues 17 and 19, as one prepared script for a machine with CUDA.
#
#   bash benchmarks/gpu_session.sh checks OUTDIR   # ~4 min: CUDA tests, gpu.py, conv paths
#   bash benchmarks/gpu_session.sh resnet OUTDIR   # ~5 min: ResNet-18 (width 64) to 90%
#   bash benchmarks/gpu_session.sh profile OUTDIR  # ~1 min: where ResNet-18's KFAC step goes
#   bash benchmarks/gpu_session.sh all OUTDIR      # <= 8 min: gpu.py, the CUDA tests and the
#                                                  # ResNet-18 profile (conv patch routes and
#                                                  # eigh solvers: measured in runs 14 and 16;
#                                                  # `checks` and eigh_solvers.py run them)
#
# Run from the repository root. The peers (ASDL, curvlinops, BackPACK) are installed from
# wheels in .whl/ when that folder exists; without them gpu.py's peer rows are left out.
# Where the package index is reachable (the development machine; .whl/ is git-ignored
# and travels with the device tool's `carry`):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl asdfghjkl==0.1a5 \
#       backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1 einconv==0.1.0 unfoldNd==0.2.3
# The resnet part needs Fashion-MNIST, which a bare GPU machine lacks: copy the Debian
# package's files into .fmnist/ (add /.fmnist/ to .git/info/exclude and carry it; 30 MB):
#   mkdir -p .fmnist && cp /usr/share/datasets/fashion-mnist/*.gz .fmnist/
# (The logs are cut with `sed -n`, which reads to the end, not `head`: a closed pipe ends
# the call with status 141 and can stop the program before it writes its files.)
# Each part writes its log and JSON into OUTDIR and has its own time limit, so a stopped
# part keeps what it wrote (gpu.py's syncs part also counts the refresh step of the CNN
# and the LM: the predictions of `python benchmarks/step_counts.py --gpu-shapes`).
# Then, on the development machine: copy the JSON into benchmarks/gpu_runs/ (add "run"
# and "code" fields), `python benchmarks/gpu.py --render <runs>` for docs/benchmarks.md's
# GPU section, and `python benchmarks/training.py --from-json <json>` for the ResNet rows
# (their JSON goes into benchmarks/gpu_runs/training/: gpu_runs/*.json are gpu.py runs).
set -u -o pipefail
mode=${1:?usage: gpu_session.sh checks|resnet|profile|all OUTDIR}
out=${2:?usage: gpu_session.sh checks|resnet|profile|all OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    peers=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$peers" .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$peers"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
case "$mode" in
checks)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_matches_cpu.py \
        tests/test_optim_syncs.py tests/test_conv_patch_gemm.py tests/test_linalg.py \
        -k "cuda or patch or cpu_takes or kron or padded" \
        2>&1 | tee "$out/tests.log" | tail -3
    timeout 330 python3 benchmarks/gpu.py --device cuda --json "$out/gpu.json" --no-doc \
        2>&1 | tee "$out/gpu.log" | tail -5
    timeout 90 python3 benchmarks/conv_weight_grads.py --device cuda 2>&1 | tee "$out/conv.txt"
    # whether the kernel-major patches of a CPU (KERNEL_MAJOR_DEVICES) pay on the GPU too
    timeout 60 python3 benchmarks/conv_patches.py --device cuda --layers gpu 2>&1 \
        | tee "$out/conv_patches.txt"
    ;;
resnet)
    fm=/usr/share/datasets/fashion-mnist
    if [ ! -d "$fm" ] && [ -d .fmnist ]; then
        mkdir -p "$fm" && cp .fmnist/*.gz "$fm"/
    fi
    timeout 560 python3 benchmarks/training.py --workloads resnet18 --resnet-width 64 \
        --seeds 0 --device cuda --resnet-budget 35 --json "$out/resnet18_gpu.json" \
        2>&1 | tee "$out/resnet18.log" | tail -30
    ;;
profile)
    # host against device time per step (AdamW, SGD, KFAC; random data) and a profile
    timeout 240 python3 benchmarks/resnet_step.py --device cuda --width 64 --batch 128 \
        --out "$out" 2>&1 | tee "$out/resnet_step.log" | sed -n 1,8p
    ;;
all)
    # issue 17's measurements first; each part bounded so the whole fits one 10-minute call
    timeout 240 python3 benchmarks/gpu.py --device cuda --json "$out/gpu.json" --no-doc \
        2>&1 | tee "$out/gpu.log" | cut -c1-110
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_matches_cpu.py \
        tests/test_optim_syncs.py tests/test_conv_patch_gemm.py tests/test_linalg.py \
        tests/test_statistics_precision.py tests/test_optim_quadratic_replay.py \
        tests/test_demo.py -k "cuda or patch or cpu_takes or kron or padded or device" \
        2>&1 | tee "$out/tests.log" | tail -3
    timeout 130 python3 benchmarks/resnet_step.py --device cuda --width 64 --batch 128 \
        --out "$out" 2>&1 | tee "$out/resnet_step.log" | sed -n 1,6p
    ;;
*)
    echo "unknown mode $mode (checks, resnet, profile or all)" >&2
    exit 2
    ;;
esac
