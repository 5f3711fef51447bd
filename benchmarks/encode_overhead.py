"""What an encode job spends outside the encoder, for one GLM-5-shaped block (issue 7, third bullet).

Times, on this machine, the pieces of fq/workflow/encode.py's encode_block other than the per-matrix
encode itself, with fq's real functions on synthetic data of GLM-5 shapes (32 experts x gate/up
(2048x6144) + down (6144x2048), bf16 source, K=2 mul1 fragment):

  process   a fresh `python -c "import fq.workflow.encode"` (interpreter start + imports) vs `python -c pass`
  cuda_init a fresh process's first CUDA tensor (CUDA only)
  identity  encoder_identity() (hashes the encoder's source files; check_encoder does this once per job)
  read      read_source(): safetensors get_tensor + bf16 -> float32 of the block's 96 matrices (page cache warm:
            the staging rule wrote the shard just before, so this is the best case)
  metrics   encode_block's per-matrix float64 sums (sum w^2, sum (rec - w)^2)
  write     write_fragment() of the block's EXL3 tensors
  attest    attest_fragment(): sha256 of the fragment and per-expert ranges, Ed25519 signature, write

    python benchmarks/encode_overhead.py [--experts 32] [--json OUT] [--tmp DIR]

The share of GPU busy time is computed by encode_speed.py, which knows the GPU seconds per matrix.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES = {"gate": (2048, 6144), "up": (2048, 6144), "down": (6144, 2048)}  # torch (out, in)
K, CODEBOOK = 2, "mul1"


def _subprocess_s(code: str, reps: int = 3) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(ROOT), capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def _cuda_init_s() -> float | None:
    if not torch.cuda.is_available():
        return None
    code = ("import time, torch; t = time.perf_counter(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
            "print(time.perf_counter() - t)")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def measure(experts: int = 32, tmp: str | None = None, log=print) -> dict:
    from safetensors.torch import save_file

    from fq.attest import keys
    from fq.attest.campaign import campaign_identity
    from fq.attest.fragment import attest_fragment
    from fq.codec.codebook import marker_value
    from fq.experts import STANDARD
    from fq.fragments import fragment_filename, write_fragment
    from fq.identity import encoder_identity
    from fq.workflow.encode import read_source

    res: dict = {"experts": experts, "matrices": 3 * experts, "K": K, "codebook": CODEBOOK, "seconds": {}}
    sec = res["seconds"]
    sec["python_start"] = _subprocess_s("pass")
    sec["process_imports"] = _subprocess_s("import fq.workflow.encode") - sec["python_start"]
    log(f"  overhead: python start {sec['python_start']:.3f} s, imports {sec['process_imports']:.3f} s")
    cuda = _cuda_init_s()
    if cuda is not None:
        sec["cuda_init"] = cuda
        log(f"  overhead: CUDA init {cuda:.3f} s")
    t = time.perf_counter()
    ident = encoder_identity()
    sec["identity"] = time.perf_counter() - t

    work = Path(tempfile.mkdtemp(prefix="fq-overhead-", dir=tmp))
    try:
        gen = torch.Generator().manual_seed(0)
        shard = work / "model-00001-of-00001.safetensors"
        names, tensors = {}, {}
        for e in range(experts):
            for p, (o, i) in SHAPES.items():
                name = STANDARD.key(3, e, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[p], "weight")
                tensors[name] = (torch.randn(o, i, generator=gen) * 0.02).bfloat16()
                names.setdefault(str(e), {})[p] = [str(shard), name]
        save_file(tensors, str(shard))
        res["source_bytes"] = shard.stat().st_size
        del tensors
        t = time.perf_counter()
        W = read_source(names)
        sec["read"] = time.perf_counter() - t
        log(f"  overhead: read {res['source_bytes'] / 1e9:.2f} GB in {sec['read']:.3f} s")

        # encode_block's metrics: two float64 sums per matrix (rec stands in for the reconstruction)
        t = time.perf_counter()
        for e, projs in W.items():
            for p, w in projs.items():
                w64 = w.double()
                rec = w  # same dtype and size as enc.W_hat
                float((w64 ** 2).sum())
                float(((rec.double() - w64) ** 2).sum())
        sec["metrics"] = time.perf_counter() - t

        sets = {}
        for e in range(experts):
            sets[e] = {}
            for p, (o, i) in SHAPES.items():
                s = {"trellis": torch.randint(-32768, 32768, (i // 16, o // 16, 16 * K), dtype=torch.int16, generator=gen),
                     "suh": torch.randn(i, generator=gen).half(), "svh": torch.randn(o, generator=gen).half()}
                s[CODEBOOK] = torch.tensor(marker_value(CODEBOOK), dtype=torch.int32)
                sets[e][{"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[p]] = s
        frag = work / fragment_filename("k2", 3, 0)
        t = time.perf_counter()
        write_fragment(frag, layout=STANDARD, node="k2", role="base", layer=3, block=0, K=K, codebook=CODEBOOK,
                       experts=sets)
        sec["write"] = time.perf_counter() - t
        res["fragment_bytes"] = frag.stat().st_size
        key_path, _, fp = keys.generate(work / "signer")
        priv = keys.load_private(key_path)
        camp = campaign_identity(name="overhead", source_repo="bench/glm5-shaped", source_revision="0" * 40,
                                 block_size=experts, signer=fp, encoder=ident["digest"])
        source = {"repo": "bench/glm5-shaped", "revision": "0" * 40,
                  "shards": [{"name": shard.name, "sha256": "2" * 64}]}
        t = time.perf_counter()
        attest_fragment(frag, key=priv, campaign=camp, source=source, encoder=ident,
                        quant_args={"K": K, "codebook": CODEBOOK, "seed": 0}, node_digest="3" * 64, parent=None)
        sec["attest"] = time.perf_counter() - t
        log(f"  overhead: fragment {res['fragment_bytes'] / 1e6:.0f} MB: write {sec['write']:.3f} s, "
            f"attest {sec['attest']:.3f} s; metrics {sec['metrics']:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sec["total_outside_encoder"] = sum(v for k, v in sec.items() if k != "python_start") + sec["python_start"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--tmp")
    a = ap.parse_args(argv)
    res = measure(a.experts, a.tmp)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
