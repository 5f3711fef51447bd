#!/usr/bin/env bash
# Issue 25 on one H200. STEP names one or more steps, run in order in one device call:
#   install      carried wheels (or .devpack/), fq's C extension, exllamav3's extension (a carried prebuilt
#                exllamav3_ext.so, else its JIT build into .exl3-ext/, ~320 s)
#   load         exllamav3 loading each published base of CAMPAIGN against fq's CPU path (tests/test_exl3_runtime.py,
#                bases only)
#   compare      benchmarks/exl3_whole_model.py: fq's bases against exllamav3's converter (REFERENCE: recipe default hq)
#   encode-cost  benchmarks/linear_encode_cost.py: the added jobs at GLM-5's shapes
#
#   STEP="install load compare" bash benchmarks/whole_model_device.sh CAMPAIGN_DIR
# from the repository root, with .whl/ and CAMPAIGN_DIR carried or, where they exceed the carry limit (64 MiB),
# .devpack/ with site.tar.xz (the wheels unzipped), campaign.tar.xz and optionally exllamav3_ext.so.xz.
set -u
CAMPAIGN=${1:?usage: whole_model_device.sh CAMPAIGN_DIR}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.exl3-ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export PYTHONUNBUFFERED=1
for s in ${STEP:?set STEP}; do
{
case "$s" in
install)
    if [ -f .devpack/site.tar.xz ]; then
        step unpack .devpack
        mkdir -p /tmp/site && tar -C /tmp/site -xJf .devpack/site.tar.xz && echo "site ok"
        [ -f .devpack/exllamav3_ext.so.xz ] && xz -dc .devpack/exllamav3_ext.so.xz >/tmp/site/exllamav3_ext.so \
            && echo "prebuilt exllamav3_ext ok"
    else
        step install carried wheels
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >"$OUT/pip.log" 2>&1
        echo "pip rc=$?"
    fi
    if [ -f .devpack/campaign.tar.xz ] && [ ! -d "$CAMPAIGN" ]; then
        mkdir -p "$CAMPAIGN" && tar -C "$CAMPAIGN" -xJf .devpack/campaign.tar.xz && echo "campaign ok"
    fi
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
    echo "build_ext rc=$?"
    step "exllamav3 extension (prebuilt, JIT build, or reuse)"
    timeout 450 python3 -c "import exllamav3, exllamav3.ext; print('exllamav3 ext ok')" 2>&1 | tail -3
    ;;
load)
    step "exllamav3 loads each published base; logits against fq's CPU path"
    FQ_EXL3_CAMPAIGN=$CAMPAIGN FQ_EXL3_JSON=$OUT/exl3_agreement.json timeout 120 \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_runtime.py -k "not chain" 2>&1 | tail -30
    ;;
compare)
    step "fq bases against exllamav3's converter (${REFERENCE:-recipe default hq})"
    python3 benchmarks/exl3_whole_model.py "$CAMPAIGN" "$OUT/wm" --reference ${REFERENCE:-recipe default hq} \
        >"$OUT/compare.log" 2>&1
    echo "compare rc=$?"
    grep "^|" "$OUT/compare.log"
    ;;
encode-cost)
    step "added jobs at GLM-5 shapes"
    python3 benchmarks/linear_encode_cost.py --device cuda:0 --json "$OUT/linear_encode_cost.json" 2>&1 | tail -20
    ;;
esac
step "$s done"
} 2>&1 | tee -a "$OUT/run.log"
done
