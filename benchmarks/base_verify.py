#!/usr/bin/env python3
"""How long ``fq combine --base DIR`` takes to verify a base checkpoint, per GB.

    python benchmarks/base_verify.py [--gb 2] [--repeat 3] [--dir DIR] [--json OUT.json]

Builds a synthetic base with fq's own writers and signer (one skeleton shard of bf16 tensors, expert
fragments of random trellis codes at K=4 with 1024x2048 experts, their attestations, config.json and the
signed base manifest: about 70% of the bytes in fragments, as in a real MoE base), then times
``fq.provenance.manifest.verify_base`` (what ``--base`` runs: the manifest, then every file listed and re-hashed in one
streamed pass, every attested shard checked against its attestation) with the page cache warm (the files were
just written; a cold read adds the disk's time), and, for scale, one plain sha256 pass over the same files
(8 MiB reads). Prints one JSON object; ``--json`` also writes it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fq.codec.codebook import marker_value  # noqa: E402
from fq.model.experts import STANDARD  # noqa: E402
from fq.provenance.attest import keys  # noqa: E402
from fq.provenance.attest.campaign import campaign_identity  # noqa: E402
from fq.provenance.attest.fragment import attest_fragment, attest_skeleton  # noqa: E402
from fq.provenance.fragments import fragment_filename, write_fragment, write_skeleton  # noqa: E402
from fq.provenance.identity import encoder_identity  # noqa: E402
from fq.provenance.manifest import verify_base, write_base_manifest  # noqa: E402

IN, OUT, K, EXPERTS_PER_BLOCK = 1024, 2048, 4, 8  # torch (out, in) = (OUT, IN) per projection


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                return f"{name}, {os.cpu_count()} cores" + (", AVX-512" if "avx512f" in flags else "") + \
                    (", SHA-NI" if " sha_ni" in flags else "")
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def build(base: Path, gb: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    key_path, pub_path, fp = keys.generate(base.parent / "bench-signer")
    priv, pub = keys.load_private(key_path), keys.load_public(pub_path)
    enc = encoder_identity()
    camp = campaign_identity(name="bench", source_repo="bench/base", source_revision="0" * 40, block_size=EXPERTS_PER_BLOCK,
                             signer=fp, encoder=enc["digest"])
    source = {"repo": "bench/base", "revision": "0" * 40, "shards": [{"name": "model-00001-of-00001.safetensors",
                                                                     "sha256": "0" * 64}]}
    base.mkdir(parents=True)
    target = int(gb * 1e9)
    n_skel = max(1, round(0.3 * target / (2 * 4096 * 4096)))  # 32 MiB bf16 tensors, 30% of the bytes
    skel = [(f"model.layers.{i}.self_attn.o_proj.weight", torch.randn(4096, 4096, generator=gen).bfloat16())
            for i in range(n_skel)]
    write_skeleton(base / "model-00001-of-00001.safetensors", tensors=skel, source_shard=source["shards"][0]["name"])
    attest_skeleton(base / "model-00001-of-00001.safetensors", key=priv, campaign=camp, source=source, encoder=enc)
    (base / "config.json").write_text(json.dumps({"model_type": "bench_moe"}))
    layer, block = 0, 0
    while sum(p.stat().st_size for p in base.iterdir()) < target:
        experts = {}
        for e in range(block * EXPERTS_PER_BLOCK, (block + 1) * EXPERTS_PER_BLOCK):
            experts[e] = {}
            for proj in STANDARD.projections:
                o, i = (IN, OUT) if proj == "down_proj" else (OUT, IN)
                experts[e][proj] = {
                    "trellis": torch.randint(-32768, 32768, (i // 16, o // 16, 16 * K), dtype=torch.int16, generator=gen),
                    "suh": torch.ones(i, dtype=torch.float16), "svh": torch.ones(o, dtype=torch.float16),
                    "mcg": torch.tensor(marker_value("mcg"), dtype=torch.int32)}
        path = base / fragment_filename("b", layer, block)
        info = write_fragment(path, layout=STANDARD, node="b", role="base", layer=layer, block=block, K=K,
                              codebook="mcg", experts=experts)
        attest_fragment(path, key=priv, campaign=camp, source=source, encoder=enc, quant_args={"K": K},
                        node_digest="0" * 64, info=info)
        block += 1
        if block == 4:
            layer, block = layer + 1, 0
    write_base_manifest(base, node="b", campaign=camp, key=priv)
    return pub, camp


def plain_sha256(base: Path) -> float:
    t = time.perf_counter()
    for p in sorted(base.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the synthetic base (default 2 GB)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs; the best is reported (default 3)")
    ap.add_argument("--dir", help="where to build it (default: a temporary directory, removed after)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(tmp) / "base"
        t = time.perf_counter()
        pub, camp = build(base, args.gb)
        built = time.perf_counter() - t
        files = sorted(base.iterdir())
        size = sum(p.stat().st_size for p in files)
        runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            verified = verify_base(base, pub, camp)
            runs.append(time.perf_counter() - t)
        sha = min(plain_sha256(base) for _ in range(args.repeat))
    gb = size / 1e9
    result = {"machine": _cpu(), "python": platform.python_version(), "torch": torch.__version__,
              "files": len(files), "attested_shards": len(verified.shards), "bytes": size, "build_s": round(built, 1),
              "verify_s": [round(r, 3) for r in runs], "verify_s_per_gb": round(min(runs) / gb, 3),
              "verify_gb_per_s": round(gb / min(runs), 3), "plain_sha256_s_per_gb": round(sha / gb, 3),
              "page_cache": "warm"}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
