#!/usr/bin/env bash
# Issue 44 on one GPU, in one device call: exllamav3 1.6.5's row for each carried family campaign
# (tests/test_exl3_families.py) and the gpt-oss probes (benchmarks/exl3_source_probe.py).
#
#   bash benchmarks/families_device.sh   (repository root; carry .devpack and .famx, made by benchmarks/device_pack.sh:
#                                         PARTS="site famx" FAMILIES="kimi_linear laguna lfm2_moe qwen3_vl_moe")
#
# Run it again on the warm machine to go on: measured rows and finished probes are skipped.
# Each campaign runs in a pytest process of its own with its own time limit (FAMILY_S, default 100 s), kimi_linear
# last (fq's reference forward runs transformers' torch fallbacks for its linear attention: the slowest by far), so
# a slow family costs only its own row. Then the gpt-oss probes (exllamav3 on the unquantized source, per expert,
# against transformers; PROBE_S each) until DEADLINE (s after the start, default 570). A device call returns at most
# 8 files: the rows merged into $OUT/families_exl3.json (merge it into docs/data/families_exl3.json), the logs in
# $OUT/families.tar.xz, exllamav3's extension packed for a later call (device_setup.sh's pack_ext).
set -u
. "$(dirname "$0")/device_setup.sh"
DEADLINE=${DEADLINE:-570}
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
LOGS=/tmp/famlogs
mkdir -p "$LOGS" /tmp/fam
install_step /nonexistent 2>&1 | tee "$LOGS/install.log"
pack_ext
for f in .famx/*.tar.xz; do tar -C /tmp/fam -xJf "$f"; done
names=$(ls /tmp/fam | grep -v '^kimi_linear$'; [ -d /tmp/fam/kimi_linear ] && echo kimi_linear)
for n in $names; do
    # a warm machine keeps $LOGS: a second call goes on where the first stopped
    [ -f "$LOGS/$n.json" ] && { echo "$n: measured by an earlier call"; continue; }
    [ "$(left)" -gt 40 ] || { echo "no time left for $n"; continue; }
    step "family $n ($(left) s left)"
    rm -rf /tmp/famone && mkdir -p /tmp/famone && ln -s "/tmp/fam/$n" "/tmp/famone/$n"
    limit=$(( $(left) - 20 < ${FAMILY_S:-100} ? $(left) - 20 : ${FAMILY_S:-100} ))
    FQ_EXL3_FAMILIES=/tmp/famone FQ_EXL3_FAMILIES_JSON="$LOGS/$n.json" timeout "$limit" \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_exl3_families.py >"$LOGS/$n.log" 2>&1
    echo "rc=$?"; grep -E "kl_ref_exl3|passed|failed|Error" "$LOGS/$n.log" | cut -c1-300 | tail -4
done
# PROBES: the probes to run (name|config overrides, space-separated; none when set empty)
PROBES=${PROBES-'p4|{"hidden_size":128,"num_attention_heads":64,"num_key_value_heads":8,"sliding_window":64}
 p1|{"num_attention_heads":64,"num_key_value_heads":8} p3|{"sliding_window":32} p2|{"num_key_value_heads":1} p0|{}'}
for c in $PROBES; do
    n=${c%%|*}; k=${c#*|}
    grep -q "^RESULT" "$LOGS/probe-$n.log" 2>/dev/null && { echo "probe $n: done by an earlier call"; continue; }
    [ "$(left)" -gt 50 ] || break
    step "gpt-oss probe $n $k"
    limit=$(( $(left) - 30 < ${PROBE_S:-120} ? $(left) - 30 : ${PROBE_S:-120} ))
    timeout "$limit" python3 benchmarks/exl3_source_probe.py "$n" GptOssForCausalLM "$k" /tmp/pr --lengths 64 160 \
        --layers >"$LOGS/probe-$n.log" 2>&1
    echo "rc=$?"; grep "^RESULT" "$LOGS/probe-$n.log" | cut -c1-600
done
python3 - "$LOGS" "$OUT/families_exl3.json" <<'EOF'
import json, pathlib, sys
rows = {}
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    rows.update(json.loads(p.read_text()))
pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
print("rows:", ", ".join(rows) or "none")
EOF
tar -C "$LOGS" -cJf "$OUT/families.tar.xz" .
step "done ($(left) s left)"
