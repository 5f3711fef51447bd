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
step() { echo; echo "=== [$(($(date +%s) - T0)) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=$PWD/.exl3-ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export PYTHONUNBUFFERED=1

install_step() {
    local campaign=$1
    if [ -f .devpack/site.tar.xz ]; then
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
    [ -f .devpack/exllamav3_ext.so.xz ] && xz -dc .devpack/exllamav3_ext.so.xz >/tmp/site/exllamav3_ext.so \
        && echo "prebuilt exllamav3_ext"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    step build fq C extension
    python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
    echo "build_ext rc=$?"
    step "exllamav3 extension (prebuilt, JIT build, or reuse)"
    timeout 480 python3 -c "import exllamav3, exllamav3.ext; print('exllamav3 ext ok')" 2>&1 | tail -3
}
