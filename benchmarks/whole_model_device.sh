#!/usr/bin/env bash
# Issue 25 on one H200, in steps that each fit one device call (STEP=setup|compare|compare-hq|encode-cost):
#   setup        carried wheels, fq's C extension, exllamav3's JIT extension (.exl3-ext/), and exllamav3 loading each
#                published base of CAMPAIGN against fq's CPU path (tests/test_exl3_runtime.py, bases only)
#   compare      benchmarks/exl3_whole_model.py: fq's bases against exllamav3's converter at each whole-model base's bits
#   compare-hq   the same with the converter's -hq
#   encode-cost  benchmarks/linear_encode_cost.py: the added jobs at GLM-5's shapes
#
#   STEP=setup bash benchmarks/whole_model_device.sh CAMPAIGN_DIR     (repository root; .whl/ and CAMPAIGN_DIR carried)
set -u
CAMPAIGN=${1:?usage: whole_model_device.sh CAMPAIGN_DIR}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.exl3-ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
{
case "${STEP:?set STEP}" in
setup)
    step install carried wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/pip.log" 2>&1
    echo "pip rc=$?"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
    echo "build_ext rc=$?"
    step "exllamav3 extension (JIT build, or reuse)"
    timeout 450 python3 -c "import exllamav3, exllamav3.ext; print('exllamav3 ext ok')" 2>&1 | tail -3
    step "exllamav3 loads each published base; logits against fq's CPU path"
    FQ_EXL3_CAMPAIGN=$CAMPAIGN FQ_EXL3_JSON=$OUT/exl3_agreement.json timeout 120 \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_runtime.py -k "not chain" 2>&1 | tail -30
    ;;
compare)
    step "fq bases against exllamav3's converter (default allocation)"
    python3 benchmarks/exl3_whole_model.py "$CAMPAIGN" "$OUT/wm" --bits 2>&1 | grep -v "^ -- \|it/s\|^\s*$" | tail -40
    ;;
compare-hq)
    step "fq bases against exllamav3's converter (-hq)"
    python3 benchmarks/exl3_whole_model.py "$CAMPAIGN" "$OUT/wm-hq" --bits --hq 2>&1 | grep -v "^ -- \|it/s\|^\s*$" | tail -40
    ;;
encode-cost)
    step "added jobs at GLM-5 shapes"
    python3 benchmarks/linear_encode_cost.py --device cuda:0 --json "$OUT/linear_encode_cost.json" 2>&1 | tail -20
    ;;
esac
step done
} 2>&1 | tee -a "$OUT/run-${STEP}.log"
