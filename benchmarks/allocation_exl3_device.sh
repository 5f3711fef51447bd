#!/usr/bin/env bash
# Issue 41 on one GPU: fq's measured-sensitivity allocation against exllamav3's converter (benchmarks/allocation_exl3.py).
# STEP names one or more steps, run in order in one device call:
#   install   benchmarks/device_setup.sh's install_step (carried .devpack/site.tar.xz or .whl/, fq's C extension,
#             exllamav3's extension: a carried .devpack/exllamav3_ext.so.xz, else its JIT build), then the built
#             extension xz-compressed to $OUT/exllamav3_ext.so.xz.part* (pack_ext) so that a later call can carry it
#   demo      the demo model and its held-out split written as `fq demo-model` writes them (the fq directories are built on the
#             CPU beforehand and carried in $FQ, default $A41/demo/fq), then `allocation_exl3.py measure` (exllamav3's -b $B and
#             -b -hq $HQ, $PAR conversions at a time; held-out texts: $A41/text/docs.txt and the demo's heldout split)
#   model     the same for a carried checkpoint and its fq directories ($MODEL_DIR, default $A41/q3: source/, fq/,
#             heldout.txt; the trained Qwen3-MoE of benchmarks/second_family_campaign.py, built on the CPU); the
#             conversions kept in /tmp/model-convert, so that a second call on the warm machine resumes them
#   bench     benchmarks/train_bench_moe.py (the benchmark MoE, trained here), then build (on the GPU) and measure;
#             with CONV_BG=1 exllamav3's conversions start right after training, beside fq's build, and `measure`
#             scores fq's directories alone (EXT_BG=1: exllamav3's extension builds meanwhile, device_setup.sh)
#   collect   waits for CONV_BG's conversions (to $DEADLINE) and copies what they measured to $OUT/bench-conv
#   seq       the whole benchmark-MoE comparison one part after another in one background driver that outlives the
#             call: train; the half-integer Viterbi's speed (benchmarks/frac_speed_probe.py: a half-integer K has no
#             CUDA kernel, and the 2-bit allocation is mostly K1.5), which picks FQ_VITERBI_FRAC for the build (the
#             host's C kernel unless the torch frac path on the GPU beat it); fq's build; then one `measure` that scores the
#             source and fq's directories while exllamav3's conversions run $PAR at a time, 16 / $PAR CPU threads
#             each (OMP_NUM_THREADS); FRAC=cpu|device skips the probe. Nothing shares the GPU with the build. The
#             measure waits for $A41/text/docs.txt, which a later call may carry. Each call waits to $DEADLINE and brings
#             back what is there ($OUT/seq.tar.xz); call it again on the warm machine until it prints "seq finished".
#
#   STEP="install demo" B=1.5,2,... HQ=1,1.5,... bash benchmarks/allocation_exl3_device.sh
# from the repository root, with .devpack (site.tar.xz[, exllamav3_ext.so.xz]) and .a41 carried. Everything the
# steps measure is written under $OUT: measure.json after every model, the converter's logs.
set -u
A41=${A41:-.a41}
PAR=${PAR:-4}
. "$(dirname "$0")/device_setup.sh"
# waits for the file $1 until $DEADLINE - 15 s after the script started; true if it is there
wait_file() {
    while [ ! -f "$1" ] && [ $(($(date +%s) - T0)) -lt $((${DEADLINE:-570} - 15)) ]; do sleep 10; done
    [ -f "$1" ]
}
for s in ${STEP:?set STEP}; do
{
case "$s" in
install)
    install_step /nonexistent
    pack_ext  # with EXT_BG still building: wait_ext packs it (PACK_EXT=1)
    ;;
demo)
    step "demo model and text"
    python3 -c "from fq.model import demo_model; demo_model.write('/tmp/a41demo/model', '/tmp/a41demo/text')" \
        && echo "demo model ok"
    step "measure (exllamav3 -b ${B:-} / -b -hq ${HQ:-}, $PAR at a time)"
    # ends by $DEADLINE seconds after the script started (default 570: one 600 s device call), measure.json kept
    timeout $((${DEADLINE:-570} - ($(date +%s) - T0))) python3 benchmarks/allocation_exl3.py measure /tmp/a41demo/model "$OUT/demo" \
        --fq "${FQ:-$A41/demo/fq}" --text "docs=$A41/text/docs.txt" --text heldout=/tmp/a41demo/text/heldout.txt \
        --b "${B:-}" --hq "${HQ:-}" --parallel "$PAR" --tokens ${TOKENS:-32768} 2>&1 | grep --line-buffered -v "^Loading weights"
    echo "measure rc=${PIPESTATUS[0]}"
    ;;
model)
    # a carried trained checkpoint (the trained Qwen3-MoE: $A41/q3/source, built on the CPU with its fq directories
    # $A41/q3/fq and held-out split $A41/q3/heldout.txt), measured as `demo` measures the demo
    M=${MODEL_DIR:-$A41/q3}
    step "measure $M/source (exllamav3 -b ${B:-} / -b -hq ${HQ:-}, $PAR at a time)"
    timeout $((${DEADLINE:-570} - ($(date +%s) - T0))) python3 benchmarks/allocation_exl3.py measure "$M/source" \
        "$OUT/model" --fq "$M/fq" --text "docs=$A41/text/docs.txt" --text "heldout=$M/heldout.txt" \
        --b "${B:-}" --hq "${HQ:-}" --parallel "$PAR" --tokens ${TOKENS:-32768} --scratch /tmp/model-convert 2>&1 \
        | grep --line-buffered -v "^Loading weights"
    echo "measure rc=${PIPESTATUS[0]}"
    ;;
bench)
    # each part is skipped when a warm machine already holds its output (/tmp/bench), so the same command goes on
    # in a second call: train, build, then measure until $DEADLINE
    if [ ! -f /tmp/bench/model/config.json ]; then
        step "train the benchmark MoE"
        python3 benchmarks/train_bench_moe.py /tmp/bench --device cuda >"$OUT/train.log" 2>&1
        echo "train rc=$?"; tail -3 "$OUT/train.log"
    fi
    cp /tmp/bench/training.json "$OUT/" 2>/dev/null
    sha256sum /tmp/bench/model/*.safetensors | tee "$OUT/bench_model.sha256"
    if [ -n "${CONV_BG:-}" ] && [ ! -f /tmp/bench/conv.started ]; then
        # exllamav3's conversions in their own process session, beside fq's build on the same GPU (the converter
        # needs only the trained model); step `collect` waits for them and brings back what they measured
        touch /tmp/bench/conv.started
        step "exllamav3's conversions in the background (-b ${B:-} / -b -hq ${HQ:-}, $PAR at a time)"
        setsid bash -c "while [ -n \"\${EXT_BG:-}\" ] && [ ! -f /tmp/exl3-ext.done ]; do sleep 5; done; \
            python3 benchmarks/allocation_exl3.py measure /tmp/bench/model /tmp/bench/conv-out \
            --text docs=$A41/text/docs.txt --text heldout=/tmp/bench/text/heldout.txt --b '${B:-}' --hq '${HQ:-}' \
            --parallel $PAR --tokens ${TOKENS:-32768} --scratch /tmp/bench/convert >/tmp/bench/conv.log 2>&1; \
            touch /tmp/bench/conv.done" </dev/null >/dev/null 2>&1 &
    fi
    [ -n "${CONV_BG:-}" ] && B= HQ=  # measured in the background: the measure below scores fq's directories
    build="python3 benchmarks/allocation_exl3.py build /tmp/bench/model /tmp/bench/text/calibration.txt /tmp/bench/a41 \
        --device cuda --bits ${BITS:-2,2.5,3,4,5} --samples ${SAMPLES:-4} --models ${MODELS:-pooled}"
    if [ -n "${CONV_BG:-}" ]; then
        # in its own process session too, so that a call's end does not cut it: a later call waits on
        if [ ! -f /tmp/bench/build.started ]; then
            touch /tmp/bench/build.started
            step "build fq's allocations on the GPU (background: /tmp/bench/build.log)"
            setsid bash -c "$build >/tmp/bench/build.log 2>&1; touch /tmp/bench/build.done" </dev/null >/dev/null 2>&1 &
        fi
        wait_file /tmp/bench/build.done; built=$?
        stdbuf -oL tr '\r' '\n' </tmp/bench/build.log | grep -v "^encoded\|^Loading" | tail -15
        [ $built = 0 ] || { echo "build still running: call again"; exit 0; }  # ends this step (a subshell)
    elif [ ! -f /tmp/bench/a41/fq/build.json ]; then
        step "build fq's allocations on the GPU"
        $build 2>&1 | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v "^encoded\|^Loading"
    fi
    cp /tmp/bench/a41/fq/build.json "$OUT/bench_build.json" 2>/dev/null
    wait_ext
    step "measure"
    # the conversions are kept in /tmp/bench/convert: a later call scores the finished ones again and resumes the
    # others from their last checkpoint (cut at $DEADLINE, the converters are stopped first, so none runs on unseen)
    timeout $((${DEADLINE:-570} - ($(date +%s) - T0))) python3 benchmarks/allocation_exl3.py measure /tmp/bench/model "$OUT/bench" \
        --fq /tmp/bench/a41/fq --text "docs=$A41/text/docs.txt" --text heldout=/tmp/bench/text/heldout.txt \
        --b "${B:-}" --hq "${HQ:-}" --parallel "$PAR" --tokens ${TOKENS:-32768} --scratch /tmp/bench/convert 2>&1 \
        | grep --line-buffered -v "^Loading weights"
    echo "measure rc=${PIPESTATUS[0]}"
    [ -n "${CONV_BG:-}" ] || { pkill -f exllamav3.conversion.convert_model && sleep 3; }
    for l in /tmp/bench/convert/*.log; do [ -f "$l" ] && { echo "--- $l"; tail -3 "$l"; }; done
    ;;
seq)
    if [ ! -f /tmp/bench/seq.started ]; then
        mkdir -p /tmp/bench/seq && touch /tmp/bench/seq.started
        step "the sequential driver starts (/tmp/bench/seq/driver.log)"
        setsid bash -c "set -x
            [ -f /tmp/bench/model/config.json ] || python3 benchmarks/train_bench_moe.py /tmp/bench --device cuda \
                >/tmp/bench/seq/train.log 2>&1
            cp /tmp/bench/training.json /tmp/bench/seq/ ; sha256sum /tmp/bench/model/*.safetensors >/tmp/bench/seq/model.sha256
            [ -z \"${FRAC:-}\" ] || echo ${FRAC:-} >/tmp/bench/seq/frac_choice
            [ -f /tmp/bench/seq/frac_choice ] || timeout 120 python3 benchmarks/frac_speed_probe.py --tiles 1024 \
                --choice /tmp/bench/seq/frac_choice >/tmp/bench/seq/frac_speed.log 2>&1
            export FQ_VITERBI_FRAC=\$(cat /tmp/bench/seq/frac_choice 2>/dev/null || echo cpu)
            [ -f /tmp/bench/a41/fq/build.json ] || python3 benchmarks/allocation_exl3.py build /tmp/bench/model \
                /tmp/bench/text/calibration.txt /tmp/bench/a41 --device cuda --bits ${BITS:-2,2.5,3} \
                --samples ${SAMPLES:-2} --models pooled 2>&1 | tr '\\r' '\\n' | grep -v '^encoded' >/tmp/bench/seq/build.log
            cp /tmp/bench/a41/fq/build.json /tmp/bench/seq/
            while [ -n \"\${EXT_BG:-}\" ] && [ ! -f /tmp/exl3-ext.done ]; do sleep 5; done
            while [ ! -f $A41/text/docs.txt ]; do sleep 5; done  # may come with a later call's carry
            OMP_NUM_THREADS=$((16 / PAR)) python3 benchmarks/allocation_exl3.py measure /tmp/bench/model /tmp/bench/seq \
                --fq /tmp/bench/a41/fq --text docs=$A41/text/docs.txt --text heldout=/tmp/bench/text/heldout.txt \
                --b '${B:-}' --hq '${HQ:-}' --parallel $PAR --tokens ${TOKENS:-32768} --scratch /tmp/bench/convert \
                2>&1 | grep -v '^Loading weights' >/tmp/bench/seq/measure.log
            touch /tmp/bench/seq.done" </dev/null >/tmp/bench/seq/driver.log 2>&1 &
    fi
    wait_file /tmp/bench/seq.done && echo "seq finished" || echo "seq still running: call again"
    [ -f /tmp/exl3-ext.done ] && [ -n "${EXT_BG:-}" ] && PACK_EXT=1 wait_ext
    mkdir -p "$OUT/seq"
    for f in /tmp/bench/seq/*; do cp "$f" "$OUT/seq/"; done
    tail -n 4 /tmp/bench/seq/driver.log /tmp/bench/seq/train.log /tmp/bench/seq/build.log /tmp/bench/seq/measure.log 2>/dev/null
    ls /tmp/bench/convert 2>/dev/null | head -20
    (cd "$OUT" && tar -cJf seq.tar.xz seq && rm -rf seq)
    ;;
collect)
    # the background conversions of `bench` with CONV_BG (scored as each finishes) until they end or $DEADLINE
    step "collect the background conversions"
    wait_file /tmp/bench/conv.done && echo "conversions done" || echo "conversions still running"
    mkdir -p "$OUT/bench-conv"
    cp /tmp/bench/conv-out/measure.json /tmp/bench/conv-out/convert.log "$OUT/bench-conv/" 2>/dev/null
    tail -5 /tmp/bench/conv.log
    ;;
esac
step "$s done"
} 2>&1 | tee -a "$OUT/run.log"
done
