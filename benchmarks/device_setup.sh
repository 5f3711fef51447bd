# Sourced by the H200 scripts (exl3_device.sh, whole_model_device.sh, exl3_chain_device.sh): $OUT, the step clock,
# the environment exllamav3 and fq need there, and install_step CAMPAIGN_DIR:
#   - the carried packages: .devpack/site.tar.xz (the wheels unzipped and xz-packed, so they and a campaign fit the
#     64 MiB carry) when present, else pip from .whl/;
#   - .devpack/deps.tar.xz: fq's own dependencies that the device image lacks (cryptography, jsonschema, ...);
#   - .devpack/campaign.tar.xz (or $CAMPAIGN_TAR) into CAMPAIGN_DIR when it holds no published/ yet;
#   - .devpack/exllamav3_ext.so.xz (an earlier machine's JIT build), which skips the ~5 min build;
#   - fq's C extension, then exllamav3's extension (prebuilt, a JIT build into .exl3-ext/, or the warm machine's).
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T0=$(date +%s)
EXT_IMPORT="import exllamav3, exllamav3.ext; print('exllamav3 ext ok')"
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.exl3-ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export PYTHONUNBUFFERED=1

install_step() {
    local campaign=$1
    # a warm machine keeps /tmp: a later call (or a second script in the same call) neither unpacks over modules
    # that running processes use nor rebuilds fq's C extension under them
    if [ -f /tmp/fq-install.done ]; then
        step "packages and fq's C extension: installed by an earlier call on this machine"
    elif [ -f .devpack/site.tar.xz ]; then
        step unpack .devpack
        mkdir -p /tmp/site && tar -C /tmp/site -xJf .devpack/site.tar.xz && echo "site ok"
        # fq's own dependencies the device image lacks (cryptography, jsonschema, ...), where carried
        [ -f .devpack/deps.tar.xz ] && tar -C /tmp/site -xJf .devpack/deps.tar.xz && echo "deps ok"
    else
        step install carried wheels
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >"$OUT/pip.log" 2>&1
        echo "pip rc=$?"
    fi
    local tarball=${CAMPAIGN_TAR:-.devpack/campaign.tar.xz}
    if [ -f "$tarball" ] && [ ! -d "$campaign/published" ]; then
        mkdir -p "$campaign" && tar -C "$campaign" -xJf "$tarball" && echo "campaign ok ($tarball)"
    fi
    if [ ! -f /tmp/fq-install.done ]; then
        [ -f .devpack/exllamav3_ext.so.xz ] && xz -dc .devpack/exllamav3_ext.so.xz >/tmp/site/exllamav3_ext.so \
            && echo "prebuilt exllamav3_ext"
        python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
        step build fq C extension
        python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
        echo "build_ext rc=$?"
        touch /tmp/fq-install.done
    fi
    step "exllamav3 extension (prebuilt, JIT build, or reuse)"
    if [ -n "${EXT_BG:-}" ] && [ -f /tmp/exl3-ext.started ]; then
        echo "started by an earlier call (/tmp/exl3-ext.log)"
    elif [ -n "${EXT_BG:-}" ]; then
        touch /tmp/exl3-ext.started
        # built in its own process session while the GPU trains or encodes (a JIT build is ~5 min of CPU only);
        # wait_ext blocks until it is there
        rm -f /tmp/exl3-ext.done
        setsid bash -c "timeout 600 python3 -c \"$EXT_IMPORT\" >/tmp/exl3-ext.log 2>&1; touch /tmp/exl3-ext.done" \
            </dev/null >/dev/null 2>&1 &
        echo "building in the background (/tmp/exl3-ext.log)"
    else
        timeout 480 python3 -c "$EXT_IMPORT" 2>&1 | tail -3
    fi
}

# Blocks until install_step's background build of exllamav3's extension has ended (EXT_BG); with PACK_EXT=1 it also
# packs it into $OUT (pack_ext) for a later call to carry.
wait_ext() {
    [ -n "${EXT_BG:-}" ] || return 0
    while [ ! -f /tmp/exl3-ext.done ]; do sleep 5; done
    tail -2 /tmp/exl3-ext.log
    [ -z "${PACK_EXT:-}" ] || pack_ext
}

# The built extension (prebuilt or JIT), xz-compressed into $OUT once, in parts of 15 MiB (a file that comes back
# holds at most 16 MiB): cat them into .devpack/exllamav3_ext.so.xz. Nothing when .devpack already carries one.
pack_ext() {
    local so
    so=$(ls /tmp/site/exllamav3_ext*.so .exl3-ext/*/exllamav3_ext*.so 2>/dev/null | head -1)
    [ -n "$so" ] && [ ! -f .devpack/exllamav3_ext.so.xz ] && [ ! -f /tmp/exl3-ext.packed ] || return 0
    xz -T0 -c "$so" | split -b 15m -d - "$OUT/exllamav3_ext.so.xz.part" && touch /tmp/exl3-ext.packed \
        && echo "extension packed from $so:" && ls -la "$OUT"/exllamav3_ext.so.xz.part*
}
