#!/usr/bin/env bash
# Issue 43 on one GPU: the campaign rehearsal at GLM-5's size (docs/benchmarks.md, "Rehearsal at GLM-5's size").
# Every call runs the same STEP list; each step skips what an earlier call on the same (warm) machine finished, and
# the campaign runs until $DEADLINE seconds after the script started, is stopped as Ctrl-C stops it (SIGINT to its
# whole process group) and resumed by the next call (Snakemake reruns the incomplete jobs). State lives in $WORK
# (default /tmp/rehearsal); a call returns $OUT/run.log and $OUT/rehearsal.tar.xz (a call returns at most 8 files).
# END (585) is when the script has collected; the campaign stops at DEADLINE (END - 40), the load step's tests run
# only in the time left before END, each once (the next call runs what is left).
#   install   benchmarks/device_setup.sh's install_step (carried .devpack/site.tar.xz and deps.tar.xz, fq's C
#             extension, exllamav3's extension), then checks that snakemake and fq import
#   source    benchmarks/rehearsal_source.py: the full-width FP8 source in $WORK/source (1 dense + 2 MoE layers of
#             $EXPERTS experts, seed $SEED; ~7 GB at 32 experts); complete shards are kept across calls
#   price     fq price and fq plan of that source, recipes/rehearsal-glm5.json, 1 GPU, ${ROWS}x${COLS} calibration
#   dryrun    the campaign config and signer key (once), then snakemake -n: every job, nothing run
#   campaign  Snakemake with profiles/local-gpu (cuda:0, gpu=2): the GPU phase (--until retire encode_linears
#             skeleton_variant: every fragment, linear fragment and skeleton shard), fq gate
#             --rehearsal 1, then finalize and its verification; nvidia-smi sampled every second (GPU busy and
#             memory; each CUDA process's memory and command line) and the disk every 5 s, appended across calls
#   verify    fq verify of the published tree under the campaign key
#   load      tests/test_exl3_runtime.py on the published tree: exllamav3 1.6.5 loads each base at real width and its
#             logits are compared with fq's reference forward; fq's chain runtime serves the stage product
#   collect   the samples, Snakemake's per-job benchmark files, job logs, encode metrics, calibration records, price,
#             plan and resume log, as $OUT/rehearsal.tar.xz (benchmarks/rehearsal_report.py makes the tables)
#
#   STEP="install source price dryrun campaign verify load collect" bash benchmarks/rehearsal_device.sh
# from the repository root, with .devpack carried (site.tar.xz, deps.tar.xz with snakemake if the image lacks it,
# exllamav3_ext.so.xz). Repeat the same command until the campaign step prints "published and verified".
set -u
WORK=${WORK:-/tmp/rehearsal}
EXPERTS=${EXPERTS:-32}
SEED=${SEED:-0}
ROWS=${ROWS:-250}
COLS=${COLS:-2048}
END=${END:-585}  # seconds after the script's start by which it has collected (one 600 s device call, less margin)
DEADLINE=${DEADLINE:-$((END - 40))}  # the campaign's stop: time left for verify (about 20 s) and collect
RECIPE=$PWD/recipes/rehearsal-glm5.json
CAMP=$WORK/campaign
CFG=$CAMP/config.yaml
. "$(dirname "$0")/device_setup.sh"
mkdir -p "$WORK/bin" "$WORK/py"
# fq and snakemake as commands (the carried packages install none): fq gate checks that finalize would find them
for tool in fq snakemake; do printf '#!/bin/sh\nexec python3 -m %s "$@"\n' "$tool" >"$WORK/bin/$tool"; done
chmod +x "$WORK/bin/fq" "$WORK/bin/snakemake"
export PATH=$WORK/bin:$PATH
# fq importable without the checkout on sys.path: Snakemake imports every snakemake_executor_plugin_* package it finds
# there, and the checkout's fq-slurm imports the stock SLURM plugin (pandas and all), which the device lacks. So
# PYTHONPATH names a folder holding fq alone, and every Python process runs with PYTHONSAFEPATH (python3 -P: the cwd,
# which -m would put first, stays off sys.path).
ln -sfn "$PWD/fq" "$WORK/py/fq"
export PYTHONPATH=/tmp/site:$WORK/py PYTHONSAFEPATH=1
echo "$(date -u +%FT%TZ) call start: STEP=${STEP:-}" >>"$WORK/calls.log"
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
left_end() { echo $((END - 15 - ($(date +%s) - T0))); }  # what a step may take and still leave collect its time

# $@ in its own session until the deadline; then SIGINT to its whole process group (what Ctrl-C in a terminal sends:
# the running jobs stop at once, Snakemake marks them incomplete and exits), 30 s grace, then SIGKILL to the group
until_deadline() {
    setsid "$@" &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$(left)" -le 0 ]; then
            echo "deadline: SIGINT to process group $pid"
            kill -INT -- "-$pid" 2>/dev/null
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
            kill -KILL -- "-$pid" 2>/dev/null
            wait "$pid"
            echo "$(date -u +%FT%TZ) stopped at the deadline: $*" >>"$WORK/resume.log"
            return 124
        fi
        sleep 2
    done
    wait "$pid"
}

start_samplers() {
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits -l 1 \
        >>"$WORK/smi_gpu.csv" 2>/dev/null &
    SAMPLERS=$!
    (   # each CUDA process's memory every second; its command line the first time it is seen
        while :; do
            nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
                | tee -a "$WORK/smi_apps.csv" | while IFS=', ' read -r _ _ pid _; do
                    [ -n "$pid" ] && ! grep -q "^$pid	" "$WORK/pids.tsv" 2>/dev/null \
                        && printf '%s\t%s\n' "$pid" "$(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-300)" \
                        >>"$WORK/pids.tsv"
                done
            sleep 1
        done ) &
    SAMPLERS="$SAMPLERS $!"
    ( while :; do echo "$(date +%s) $(df -B1 --output=used "$WORK" | tail -1)" >>"$WORK/disk.log"; sleep 5; done ) &
    SAMPLERS="$SAMPLERS $!"
}
stop_samplers() { for p in $SAMPLERS; do kill "$p" 2>/dev/null; done; }

# targets and options first: --configfile (like --resources) takes every word after it
# a command, not a function: until_deadline starts it with setsid
printf '#!/bin/sh\nexec python3 -m snakemake "$@" -s %s --directory %s --configfile %s\n' "$PWD/Snakefile" "$CAMP" "$CFG" \
    >"$WORK/bin/smk"
chmod +x "$WORK/bin/smk"

for s in ${STEP:?set STEP}; do
{
case "$s" in
install)
    if [ -f "$WORK/.installed" ] && python3 -c "import fq.codec._trellis" 2>/dev/null; then
        echo "installed by an earlier call"
    else
        install_step /nonexistent
        python3 -c "import snakemake, fq; print('snakemake', snakemake.__version__)" && touch "$WORK/.installed" \
            || echo "!! snakemake or fq does not import: carry snakemake (and its dependencies) in .devpack/deps.tar.xz"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h "$WORK" | tail -1
    ;;
source)
    if [ -f "$WORK/source/rehearsal.json" ]; then
        echo "source written by an earlier call"
    else
        step "full-width source: $EXPERTS experts per MoE layer, seed $SEED"
        until_deadline python3 benchmarks/rehearsal_source.py "$WORK/source" --experts "$EXPERTS" --seed "$SEED" ${SOURCE_ARGS:-} \
            2> >(stdbuf -oL tr '\r' '\n' | awk 'NR % 20 == 0' >&2)
        echo "source rc=$?"
    fi
    ;;
price)
    if [ ! -f "$WORK/price.txt" ]; then
        # the packaged cost table is the H200's: on an H100 the price is still the H200's (say so beside the figures)
        python3 -m fq price "$RECIPE" --model "$WORK/source" --gpus 1 --calibration "${ROWS}x${COLS}" \
            --windows-on-disk 1 >"$WORK/price.txt" 2>&1
        echo "price rc=$?"
        python3 -m fq plan "$RECIPE" --model "$WORK/source" --block-size 32 --calibration "${ROWS}x${COLS}" \
            --windows-on-disk 1 --out "$WORK/plan.json" >"$WORK/plan.txt" 2>&1
        echo "plan rc=$?"
    fi
    cat "$WORK/price.txt"
    ;;
dryrun)
    mkdir -p "$CAMP" "$WORK/keys"
    [ -f "$WORK/keys/signer.key" ] || python3 -m fq keygen --out "$WORK/keys/signer"
    if [ ! -f "$CFG" ]; then
        sha=$(sha256sum "$WORK/source/calibration.txt" | cut -d' ' -f1)
        cat >"$CFG" <<EOF
campaign: rehearsal-glm5
out: $CAMP/out
source: {kind: local, path: $WORK/source, revision: rehearsal-seed$SEED-e$EXPERTS}
recipe: $RECIPE
usage: null
block_size: 32
windows: null
disk_budget: null
windows_on_disk: 1
signer_key: $WORK/keys/signer.key
encode: {device: cuda, devices: [0], threads: 2, seed: 0, per_job: layer}
compare_native: false
calibration: {text: $WORK/source/calibration.txt, sha256: $sha, rows: $ROWS, columns: $COLS, capture: all-experts, compare_weight_only: false}
eval: null
assembly: {version: 1, expires: "2030-01-01T00:00:00Z"}
EOF
    fi
    smk -n --quiet rules >"$WORK/dryrun.txt" 2>&1
    echo "dry run rc=$?"
    cat "$WORK/dryrun.txt" | tail -40
    ;;
campaign)
    if [ -f "$CAMP/out/published.verified" ]; then
        echo "published and verified by an earlier call"
    else
        start_samplers
        rc=0
        if [ ! -f "$WORK/retired" ]; then
            step "GPU phase (--until retire), $(left) s left in this call"
            echo "$(date +%s) gpu-phase start" >>"$WORK/phases.log"
            # --until retire alone leaves the whole-model base's linear jobs (and the head's calibration) to finalize:
            # they read skeleton shards, not a staged window, so no window's retirement waits for them
            until_deadline smk --profile "$PWD/profiles/local-gpu" --resources gpu=2 \
                --until retire encode_linears skeleton_variant; rc=$?
            echo "$(date +%s) gpu-phase rc=$rc" >>"$WORK/phases.log"
            echo "GPU phase rc=$rc"
            if [ "$rc" = 0 ]; then
                python3 -m fq gate --configfile "$CFG" --directory "$CAMP" --rehearsal 1 >"$WORK/gate.txt" 2>&1
                echo "gate rc=$?"; cat "$WORK/gate.txt"
                touch "$WORK/retired"
            fi
        fi
        if [ -f "$WORK/retired" ] && [ "$(left)" -gt 0 ]; then
            step "finalize and its verification, $(left) s left in this call"
            echo "$(date +%s) finalize start" >>"$WORK/phases.log"
            # targets first: --resources takes every word after it
            until_deadline smk "$CAMP/out/campaign_summary.json" "$CAMP/out/published.verified" \
                --profile "$PWD/profiles/local-gpu" --resources gpu=2; rc=$?
            echo "$(date +%s) finalize rc=$rc" >>"$WORK/phases.log"
            echo "finalize rc=$rc"
        fi
        stop_samplers
        [ -f "$CAMP/out/published.verified" ] && echo "published and verified" \
            || echo "not finished: run the same command again (the campaign resumes)"
    fi
    ;;
verify)
    if [ -d "$CAMP/out/published" ]; then
        python3 -m fq verify "$CAMP/out/published" --key "$WORK/keys/signer.pub" 2>&1 | tail -5
        echo "verify rc=${PIPESTATUS[0]}"
    else
        echo "nothing published yet"
    fi
    ;;
load)
    # the campaign as tests/test_exl3_runtime.py reads one (published/, signer.pub, source/), by links
    if [ -f "$CAMP/out/published.verified" ]; then
        mkdir -p "$WORK/exl3"
        ln -sfn "$CAMP/out/published" "$WORK/exl3/published"; ln -sfn "$WORK/source" "$WORK/exl3/source"
        cp "$WORK/keys/signer.pub" "$WORK/exl3/signer.pub"
        # each test only in the time left before collect (the first H100 call spent 262 s in the first and was
        # stopped in the second: a whole call may be needed, and the next call does what is left)
        for t in base chain; do
            [ -f "$WORK/load-$t.done" ] && { echo "load $t: done by an earlier call"; continue; }
            if [ "$(left_end)" -lt 60 ]; then echo "load $t: $(left_end) s left; run the same command again"; continue; fi
            case $t in
            base) k="not chain"; what="exllamav3 loads each published base at real width; its logits against fq's \
reference forward" ;;
            chain) k="chain"; what="fq's exllamav3 chain runtime serves the stage product" ;;
            esac
            step "load $t: $what, $(left_end) s left"
            FQ_EXL3_CAMPAIGN=$WORK/exl3 FQ_EXL3_JSON=$WORK/exl3_agreement.json \
                FQ_EXL3_CHAIN_JSON=$WORK/exl3_chain_agreement.json timeout "$(left_end)" \
                python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_runtime.py -k "$k" >"$WORK/load-$t.log" 2>&1
            rc=$?
            tail -15 "$WORK/load-$t.log"
            echo "load $t rc=$rc"
            # done: passed, and nothing skipped (a skip is a test that did not look)
            [ "$rc" = 0 ] && ! grep -q skipped "$WORK/load-$t.log" && touch "$WORK/load-$t.done"
        done
    else
        echo "nothing published and verified yet"
    fi
    ;;
collect)
    # one file back (a call returns at most 8): the samples, logs and records, the campaign's benchmark files, job
    # logs, encode metrics (each job's timeline) and calibration records; benchmarks/rehearsal_report.py reads it
    du -sb "$WORK/source" "$CAMP/out" 2>/dev/null | tee "$WORK/du.txt"
    cp "$CFG" "$WORK/config.yaml" 2>/dev/null; cp "$WORK/source/rehearsal.json" "$WORK/rehearsal.json" 2>/dev/null
    (cd "$WORK" && ls smi_gpu.csv smi_apps.csv pids.tsv disk.log resume.log phases.log calls.log gate.txt du.txt \
        price.txt plan.txt plan.json dryrun.txt config.yaml rehearsal.json load-*.log exl3_agreement.json \
        exl3_chain_agreement.json run.log 2>/dev/null) >"$WORK/collect.list"
    (cd "$CAMP/out" && ls -d benchmarks logs metrics calibration/*.json campaign_summary.json 2>/dev/null) \
        >"$WORK/collect-out.list"
    tar -cJf "$OUT/rehearsal.tar.xz" -C "$WORK" -T "$WORK/collect.list" -C "$CAMP/out" -T "$WORK/collect-out.list"
    ls -la "$OUT"
    ;;
*)
    echo "unknown step $s"
    ;;
esac
step "$s done"
} 2>&1 | tee -a "$OUT/run.log" "$WORK/run.log"
done
