#!/usr/bin/env bash
# Issue 25 on one H200. STEP names one or more steps, run in order in one device call:
#   install      benchmarks/device_setup.sh's install_step: carried wheels (or .devpack/), fq's C extension,
#                exllamav3's extension (a carried prebuilt exllamav3_ext.so, else its JIT build into .exl3-ext/, ~320 s)
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
. "$(dirname "$0")/device_setup.sh"
for s in ${STEP:?set STEP}; do
{
case "$s" in
install)
    install_step "$CAMPAIGN"
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
