#!/usr/bin/env bash
# Issue 26 on one H200. STEP names one or more steps, run in order in one device call:
#   install  carried wheels (.whl/), fq's C extension, exllamav3's extension (JIT build into .exl3-ext/, ~5 min,
#            reused by later calls while the machine stays warm)
#   exact    benchmarks/exl3_chain_exact.py CAMPAIGN: where each chain product departs from its exact reconstruction
#   test     tests/test_exl3_runtime.py on CAMPAIGN (bases, chains, generation)
#   speed    benchmarks/exl3_chain_glm5_speed.py: a K2 + K1 chain against native K3 on GLM-5-shaped MoE layers
#
#   STEP="install exact speed" bash benchmarks/exl3_chain_device.sh CAMPAIGN_DIR
# from the repository root, with .whl/ and CAMPAIGN_DIR carried (a published demo campaign: published/, signer.pub,
# demo-model/), or, where they exceed the 64 MiB carry, .devpack/ with site.tar.xz (the wheels unzipped),
# campaign.tar.xz and exllamav3_ext.so.xz (an earlier machine's build). Everything lands in $OUT.
set -u
CAMPAIGN=${1:?usage: exl3_chain_device.sh CAMPAIGN_DIR}
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
    if [ -f .devpack/site.tar.xz ]; then  # the wheels unzipped and xz-packed: they and a campaign fit the carry
        step unpack .devpack
        mkdir -p /tmp/site && tar -C /tmp/site -xJf .devpack/site.tar.xz && echo "site ok"
    else
        step install carried wheels
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >"$OUT/pip.log" 2>&1
        echo "pip rc=$?"
    fi
    if [ -f .devpack/campaign.tar.xz ] && [ ! -d "$CAMPAIGN/published" ]; then
        mkdir -p "$CAMPAIGN" && tar -C "$CAMPAIGN" -xJf .devpack/campaign.tar.xz && echo "campaign ok"
    fi
    # a prebuilt exllamav3 extension (what an earlier machine's JIT build gave): skips the ~5 min build
    [ -f .devpack/exllamav3_ext.so.xz ] && xz -dc .devpack/exllamav3_ext.so.xz >/tmp/site/exllamav3_ext.so \
        && echo "prebuilt exllamav3_ext"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
    echo "build_ext rc=$?"
    step "exllamav3 extension (JIT build, or reuse)"
    timeout 480 python3 -c "import exllamav3, exllamav3.ext; print('exllamav3 ext ok')" 2>&1 | tail -3
    ;;
exact)
    step "chain products against their exact reconstruction"
    timeout 300 python3 benchmarks/exl3_chain_exact.py "$CAMPAIGN" --json "$OUT/chain_exact.json" ${EXACT_ARGS:-} \
        >"$OUT/exact.log" 2>&1
    echo "exact rc=$?"
    tail -c 6000 "$OUT/exact.log"
    ;;
test)
    step "tests/test_exl3_runtime.py"
    FQ_EXL3_CAMPAIGN=$CAMPAIGN FQ_EXL3_JSON=$OUT/exl3_agreement.json FQ_EXL3_CHAIN_JSON=$OUT/exl3_chain_agreement.json \
        FQ_EXL3_GEN_JSON=$OUT/exl3_generation.json timeout 300 \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_runtime.py ${TEST_ARGS:-} 2>&1 | tail -40
    ;;
speed)
    step "GLM-5-shaped MoE layer: chain K2 + K1 against native K3"
    timeout 420 python3 benchmarks/exl3_chain_glm5_speed.py /tmp/glm5speed --json "$OUT/chain_glm5_speed.json" \
        ${SPEED_ARGS:-} 2>&1 | tail -40
    ;;
*)
    echo "unknown step $s"
    ;;
esac
} 2>&1 | tee -a "$OUT/run.log"
done
step done
