#!/usr/bin/env bash
# Issue 26 on one H200. STEP names one or more steps, run in order in one device call:
#   install  benchmarks/device_setup.sh's install_step: the carried packages, fq's C extension, exllamav3's
#            extension (prebuilt from .devpack, or a JIT build into .exl3-ext/, ~5 min, reused while the machine is warm)
#   exact    benchmarks/exl3_chain_exact.py CAMPAIGN: where each chain product departs from its exact reconstruction
#   test     tests/test_exl3_runtime.py on CAMPAIGN (bases, chains, generation)
#   speed    benchmarks/exl3_chain_glm5_speed.py: a K2 + K1 chain against native K3 on GLM-5-shaped MoE layers
#   repeat   benchmarks/exl3_generate_repeat.py CAMPAIGN, in three processes: is greedy generation repeatable
#
#   STEP="install exact speed" bash benchmarks/exl3_chain_device.sh CAMPAIGN_DIR
# from the repository root, with .whl/ and CAMPAIGN_DIR carried (a published demo campaign: published/, signer.pub,
# demo-model/), or, where they exceed the 64 MiB carry, .devpack/ with site.tar.xz (the wheels unzipped),
# campaign.tar.xz and exllamav3_ext.so.xz (an earlier machine's build). Everything lands in $OUT.
set -u
CAMPAIGN=${1:?usage: exl3_chain_device.sh CAMPAIGN_DIR}
. "$(dirname "$0")/device_setup.sh"
for s in ${STEP:?set STEP}; do
{
case "$s" in
install)
    install_step "$CAMPAIGN"
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
repeat)
    step "is greedy generation repeatable (fresh Generator per repeat)"
    for i in 1 2 3; do  # three processes: exllamav3 picks its GEMM kernels per process
        timeout 200 python3 benchmarks/exl3_generate_repeat.py "$CAMPAIGN" --json "$OUT/generate_repeat_$i.json" \
            ${REPEAT_ARGS:-} 2>&1 | tail -5
    done
    python3 -c "
import json, sys
runs = [json.load(open(f'$OUT/generate_repeat_{i}.json')) for i in (1, 2, 3)]
for name in runs[0]:
    toks = [r[name]['tokens'] for r in runs]
    print(name, 'prompts whose tokens differ between processes:',
          sum(any(t[i] != toks[0][i] for t in toks) for i in range(len(toks[0]))))
"
    ;;
*)
    echo "unknown step $s"
    ;;
esac
} 2>&1 | tee -a "$OUT/run.log"
done
step done
