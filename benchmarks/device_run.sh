#!/usr/bin/env bash
# One GPU session for issue 7: install the carried wheels, build fq's C extension, run the codec tests
# (CUDA kernel vs CPU kernel, golden files, encoder), then benchmarks/encode_speed.py (fq vs the reference
# exllamav3 1.6.5 kernels on identical inputs). Everything lands in $OUT (default ./device-out):
#   run.log              this script's whole output
#   pytest.log/.xml      the tests
#   encode_speed.json    the benchmark (rewritten after each phase, so a timeout keeps what ran)
#   ptxas.txt            registers/spills of fq's kernel as this machine's nvcc compiles it
# No step aborts the run; each prints its exit code. Worst case ~9.3 min (hard timeouts), expected ~5.
#
#   bash benchmarks/device_run.sh        (from the repository root; needs .whl/ carried)
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }

main() {
    step environment
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 || true
    if command -v nvcc >/dev/null; then nvcc --version | tail -2; else echo "!! nvcc not on PATH"; fi
    python3 --version
    nproc

    step install carried wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/pip.log" 2>&1
    echo "pip rc=$?"
    export PYTHONPATH=/tmp/site:$PWD
    export FQ_CUDA_CACHE=/tmp/fq-cuda-cache
    python3 -c "import torch, numpy, safetensors, tqdm, yaml, jsonschema, cryptography, pytest
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))
import importlib.util as u; print('exllamav3 wheel installed:', u.find_spec('exllamav3') is not None)" \
        || echo "!! a dependency does not import"

    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
    echo "build_ext rc=$?"; tail -3 "$OUT/build_ext.log"

    step "fq CUDA kernel: ptxas report (sm_90)"
    timeout 60 nvcc -O3 -std=c++17 -fmad=false -gencode=arch=compute_90,code=sm_90 -Xptxas -v -cubin \
        -o /tmp/fq_viterbi.cubin fq/codec/_viterbi_cuda.cu >"$OUT/ptxas.txt" 2>&1
    echo "nvcc rc=$?"; grep -A2 "fq_viterbi_forward" "$OUT/ptxas.txt" | grep -E "spill|Used" | head -16

    step tests
    timeout 180 python3 -m pytest -q -p no:cacheprovider --timeout 150 --junitxml="$OUT/pytest.xml" \
        tests/test_codec_cuda.py tests/test_codec_golden.py tests/test_codec_encoder.py \
        tests/test_codec_pipeline.py >"$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"
    grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30

    step benchmark
    timeout 300 python3 benchmarks/encode_speed.py --json "$OUT/encode_speed.json" --budget-s 230 \
        --build-dir /tmp/fqref-build
    echo "benchmark rc=$?"

    step done
    ls -la "$OUT"
}

main 2>&1 | tee "$OUT/run.log"
