#!/usr/bin/env bash
# One GPU session for issue 18's encoder: the LDLQ codec's CUDA tests (CPU and CUDA encodes byte-identical, incl. a
# 2048x6144 case), then benchmarks/ldlq_quality.py at GLM-5 shape against exllamav3 1.6.5's quantize_exl3 (quality per
# K, and time per matrix batched). Everything lands in $OUT (default ./device-out).
#
#   bash benchmarks/ldlq_device.sh        (repository root; .whl/ carried with exllamav3 1.6.5 and its wheels, as for
#                                          benchmarks/exl3_device.sh)
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }
{
    step install carried wheels
    [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl >"$OUT/pip.log" 2>&1
    export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.exl3-ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1; echo "build_ext rc=$?"

    step "LDLQ codec tests (CUDA == CPU, bytes)"
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_codec_ldlq.py 2>&1 | tail -8

    step "exllamav3 extension (JIT build, or reuse)"
    timeout 400 python3 -c "import exllamav3.ext" 2>&1 | tail -3

    step "proxy error and time per K: fq weight-only, fq LDLQ, exllamav3 quantize_exl3 (GLM-5 shape)"
    timeout 600 python3 benchmarks/ldlq_quality.py --device cuda:0 --batch ${BATCH:-6} --ref-scaled \
        --json "$OUT/ldlq_quality.json" 2>&1 | tail -60
    step done
} 2>&1 | tee "$OUT/run.log"
