#!/usr/bin/env bash
# One GPU session for issue 16: a published demo campaign in exllamav3 1.6.5 (tests/test_exl3_runtime.py: bases and
# chain products), chain speed against the base (benchmarks/exl3_chain_speed.py), then the codec's CUDA tests
# against the C kernel as built on that machine (CODEC_TESTS=0 skips them). Everything lands in $OUT (./device-out).
#
#   bash benchmarks/exl3_device.sh CAMPAIGN_DIR     (repository root; .whl/ carried with exllamav3 1.6.5 and the
#                                                   wheels docs/benchmarks.md lists; CAMPAIGN_DIR carried too)
# exllamav3 JIT-builds its extension (194 files, ~4 min with 16 jobs) into .exl3-ext/ at first import; a later call on
# the same warm machine reuses it.
set -u
CAMPAIGN=${1:?usage: exl3_device.sh CAMPAIGN_DIR}
. "$(dirname "$0")/device_setup.sh"
{
    install_step "$CAMPAIGN"
    step "exllamav3 loads each base and each chain product (sums of EXL3 GEMMs); logits against fq's CPU path"
    FQ_EXL3_CAMPAIGN=$CAMPAIGN FQ_EXL3_JSON=$OUT/exl3_agreement.json FQ_EXL3_CHAIN_JSON=$OUT/exl3_chain_agreement.json \
        timeout 300 \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_runtime.py 2>&1 | tail -30

    step "chain products against the base alone: forward tokens/s"
    timeout 300 python3 benchmarks/exl3_chain_speed.py "$CAMPAIGN" --json "$OUT/exl3_chain_speed.json" 2>&1 | tail -40

    [ "${CODEC_TESTS:-1}" = 0 ] && { step done; exit 0; }
    step "codec CUDA tests"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/test_codec_cuda.py tests/test_codec_golden.py \
        tests/test_codec_isa.py 2>&1 | tail -5
    step done
} 2>&1 | tee "$OUT/run.log"
