#!/usr/bin/env bash
# The device pack, made anew on the dev machine (a fresh checkout has none: every part is ignored through
# .git/info/exclude and never committed). Then carry what a device script needs (64 MiB in all with the tree).
#   .whl/               the cp312 wheels the device image lacks (transformers 5.24.0, exllamav3 1.6.5, what they and
#                       fq import there); pip download, so the package index must be reachable
#   .devpack/site.tar.xz  the same wheels unzipped and xz-packed (15 MB where .whl/ is 30 MB): install_step unpacks it
#   .devpack/deps.tar.xz  with PARTS containing deps: Snakemake and what it imports, for the device's Python 3.12
#                       (issue 43's rehearsal runs the workflow there; the image has none): the pure-Python packages of
#                       its dependency closure copied from .venv, the compiled ones as cp312 wheels (pip download;
#                       connection_pool >= 0.0.3 has no wheel, so pip cannot resolve the closure for 3.12), pulp's
#                       CBC binaries left out (Snakemake then schedules greedily, as it says); about 6 MB
#   .a41/text/docs.txt  with PARTS containing text or a41: the held-out `docs` text (fq's docs at 166b015; seconds)
#   .a41/demo/          with PARTS containing a41: the demo's half-integer-K allocations (docs/benchmarks.md,
#                       "fq allocation against exllamav3's converter", "The demo model"; about 12 min on 2 cores)
#   .a41/q3/            with PARTS containing q3: the trained Qwen3-MoE, its splits and fq's allocations of it
#                       (docs/benchmarks.md, "The trained Qwen3-MoE"; about 7 min on 2 cores)
#   .famx/NAME.tar.xz   with PARTS containing famx: the published family campaigns of FAMILIES (benchmarks/
#                       family_campaigns.py, 35-50 s each on 2 cores), xz-packed one per campaign
#
#   PARTS="site a41 famx" FAMILIES="afmoe laguna" bash benchmarks/device_pack.sh     (repository root, .venv made)
#   PARTS="site deps" bash benchmarks/device_pack.sh                                  (the rehearsal's pack)
set -euo pipefail
PARTS=${PARTS:-site}
PY=.venv/bin/python
mkdir -p .git/info
for p in .whl/ .devpack/ .a41/ .famc/ .famx/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude
done
case " $PARTS " in *" site "*)
    mkdir -p .whl .devpack
    (cd .whl && pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        exllamav3==1.6.5 transformers==5.24.0 marisa_trie==1.4.1 pydantic==2.12.5 pydantic_core==2.41.5 \
        annotated_types==0.8.0 typing_inspection==0.4.5 llguidance==1.6.1 cryptography==50.0.2 cffi==2.1.1 \
        pycparser==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
    tmp=$(mktemp -d)
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$tmp"; done
    (cd "$tmp" && tar -cf - . | xz -T0 -9) >.devpack/site.tar.xz.tmp && mv .devpack/site.tar.xz.tmp .devpack/site.tar.xz
    rm -rf "$tmp"; ls -la .devpack/site.tar.xz ;;
esac
case " $PARTS " in *" deps "*)
    mkdir -p .devpack
    tmp=$(mktemp -d)
    "$PY" benchmarks/device_deps.py "$tmp"
    (cd "$tmp" && tar -cf - . | xz -T0 -6) >.devpack/deps.tar.xz.tmp && mv .devpack/deps.tar.xz.tmp .devpack/deps.tar.xz
    rm -rf "$tmp"; ls -la .devpack/deps.tar.xz ;;
esac
case " $PARTS " in *" text "*|*" a41 "*)
    mkdir -p .a41/text
    for f in calibration codec eval families provenance tp workflow whole_model planning pricing promote runbook \
        slurm testing; do git show 166b015:docs/$f.md; echo; echo "<|endoftext|>"; done >.a41/text/docs.txt ;;
esac
case " $PARTS " in *" a41 "*)
    .venv/bin/fq demo-model /tmp/a41/demo/model --text /tmp/a41/demo/text
    "$PY" benchmarks/allocation_exl3.py build /tmp/a41/demo/model /tmp/a41/demo/text/calibration.txt .a41/demo \
        --bits 2,2.5,3 --ks 1-8 --samples 8 --sens-rows 32 --sens-cols 256 --hess-tokens 65536 --threads 2 ;;
esac
case " $PARTS " in *" q3 "*)
    # the trained Qwen3-MoE (benchmarks/second_family_campaign.py's training: the CPU, float32, deterministic; its
    # shards' sha256 in docs/data/allocation_qwen3_cpu.json), the demo's calibration and held-out splits, and fq's
    # allocations of it (about 4 + 3 min on 2 cores); 15 MB
    mkdir -p .a41/q3
    "$PY" - <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import second_family_campaign
from fq.model import demo_model
second_family_campaign.train(Path(".a41/q3"), 450)
for split in ("calibration", "heldout"):
    Path(f".a41/q3/{split}.txt").write_text(demo_model.text(split), encoding="utf-8")
EOF
    (cd .a41/q3/source && sha256sum *.safetensors)
    "$PY" benchmarks/allocation_exl3.py build .a41/q3/source .a41/q3/calibration.txt .a41/q3 \
        --bits 2.6,3,3.5,4,4.5 --ks 1-8 --samples 8 --sens-rows 32 --sens-cols 256 --hess-tokens 65536 --threads 2 ;;
esac
case " $PARTS " in *" famx "*)
    # shellcheck disable=SC2086
    "$PY" benchmarks/family_campaigns.py .famc --only ${FAMILIES:?name the campaigns (family_campaigns.py names)}
    mkdir -p .famx
    for n in $FAMILIES; do tar -C .famc -cf - "$n" | xz -T0 -6 >".famx/$n.tar.xz"; done
    du -ch .famx/* | tail -1 ;;
esac
