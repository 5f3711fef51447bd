"""Where an encode job's time goes, per job and per block, for encode.per_job = block and = layer (issues 7, 10).

Runs fq's real encode job function (fq.workflow.encode.encode_blocks: claims, key and encoder checks, the
reader and writer threads, write + sha256 + Ed25519 attestation + metrics of every block) on synthetic data of
GLM-5 shapes: blocks of --experts experts x (gate, up (2048x6144), down (6144x2048)) in torch (out, in), bf16
source shard, a K=2 mul1 base. Every block reads the same --experts source tensors (one shard of one block's
size serves any number of blocks, read through get_tensor each time as a real job does).

  per_job=block  --blocks jobs of one block each
  per_job=layer  one job of --blocks blocks

Each job runs in this process after a warm-up encode, so its wall time holds no process start or CUDA init;
those are measured once in fresh processes and charged to every job:

  process     `python -c "import snakemake.script, fq.workflow.encode"` less `python -c pass` (what a Snakemake
              script job imports; fq.workflow.encode alone where snakemake is not installed) plus the interpreter
              start
  first_call  in a fresh process, the first encode of a 128x128 matrix on the device (CUDA context, kernel load)

and the table reports, per job: wall, busy (the summed time inside the encoder calls: GPU busy on CUDA, where
each call returns its tensors on the host), the rest of the wall (reading not hidden behind the encoder,
claims and checks, the last commit), and the share (rest + process + first_call) / busy -- issue 7's measure,
target <= 0.02. Per block: encoder seconds, seconds waiting for the reader and for the writer, and when the
block was encoded and committed. It also checks that both modes wrote byte-identical fragments.

    python benchmarks/encode_job.py --device cuda --devices 0 --blocks 4 --json encode_job.json --tmp /tmp  # H200
    python benchmarks/encode_job.py --device cpu --experts 1 --blocks 2 --scale 16                # smoke test

Not counted: the Snakemake side of a job (the launcher's bookkeeping, and on SLURM the Snakefile parse of each
SLURM job -- once per group job with profiles/slurm's fq-slurm, once per member too with `--executor slurm`:
docs/slurm.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

SHAPES = {"gate": (2048, 6144), "up": (2048, 6144), "down": (6144, 2048)}  # GLM-5 routed expert, torch (out, in)
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
LAYER, NODE = 3, "k2"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _best_s(args: list[str], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, env=_env(), cwd=str(ROOT), capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


FIRST_CALL = """
import time, torch
from fq.codec import encode
dev = {dev!r}
w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
encode(w, {K}, {codebook!r}, 0, dev)
if dev != "cpu":
    torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def fresh_process(dev: str, K: int, codebook: str, reps: int) -> dict:
    """Per-job costs a real job pays before its first block: interpreter start, imports, first encode call."""
    start = _best_s(["-c", "pass"], reps)
    what = "snakemake.script, fq.workflow.encode"
    try:
        imports = _best_s(["-c", f"import {what}"], reps) - start
    except subprocess.CalledProcessError:  # a GPU box with fq's wheels only: the job's own imports
        what = "fq.workflow.encode (snakemake is not installed here)"
        imports = _best_s(["-c", "import fq.workflow.encode"], reps) - start
    firsts = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", FIRST_CALL.format(dev=dev, K=K, codebook=codebook)], check=True,
                             env=_env(), cwd=str(ROOT), capture_output=True, text=True).stdout
        firsts.append(float(out.strip().splitlines()[-1]))
    return {"python_start_s": start, "imports_s": max(imports, 0.0), "imports": what, "first_call_s": min(firsts)}


def make_source(work: Path, experts: int, scale: int = 1, seed: int = 0, shapes: dict | None = None) -> tuple[Path, dict]:
    """One bf16 shard with ``experts`` experts' three matrices (GLM-5's shapes / ``scale``, or ``shapes``);
    returns it and {expert: {proj: tensor name}}."""
    from safetensors.torch import save_file

    from fq.model.experts import STANDARD

    gen = torch.Generator().manual_seed(seed)
    shard = work / "model-00001-of-00001.safetensors"
    names, tensors = {}, {}
    for e in range(experts):
        for p, (o, i) in (shapes or SHAPES).items():
            name = STANDARD.key(LAYER, e, PROJ[p], "weight")
            tensors[name] = (torch.randn(o // scale, i // scale, generator=gen) * 0.02).bfloat16()
            names.setdefault(e, {})[p] = name
    save_file(tensors, str(shard))
    return shard, names


def make_campaign(work: Path, kind: str, experts: int, *shards: Path) -> tuple[Path, Path]:
    """A campaign.json binding a fresh signer and this encoder build, as init writes it, over the source ``shards``."""
    from fq.core import canonical
    from fq.provenance.attest import keys
    from fq.provenance.attest.campaign import campaign_identity
    from fq.provenance.identity import encoder_identity

    key_path, _, fp = keys.generate(work / "signer")
    enc = encoder_identity(kind)
    ident = campaign_identity(name="encode-job-bench", source_repo="bench/glm5-shaped", source_revision="0" * 40,
                              block_size=experts, signer=fp, encoder=enc["digest"])
    doc = {"format": "fq-campaign/1", "identity": ident, "encoder": enc, "device": kind, "public_key": "signer.pub",
           "source": {"kind": "local", "repo": "bench/glm5-shaped", "revision": "0" * 40,
                      # the attestation names the shard's sha256; a placeholder (hashing GBs is not the job's work)
                      "shards": {shard.name: {"size": shard.stat().st_size, "sha256": "2" * 64} for shard in shards}}}
    path = work / "campaign.json"
    path.write_text(canonical.pretty(doc))
    return path, Path(key_path)


def small_campaign(work: Path) -> dict:
    """The tests' two-expert, 128 x 128 source and its CPU campaign: {work, shard, names, campaign, key}."""
    shard, names = make_source(work, experts=2, shapes={p: (128, 128) for p in SHAPES})
    campaign, key = make_campaign(work, "cpu", 2, shard)
    return {"work": work, "shard": shard, "names": names, "campaign": campaign, "key": key}


def block_jobs(out: Path, blocks: int, experts: int, shard: Path, names: dict, K: int, codebook: str) -> list:
    from fq.provenance.fragments import fragment_filename
    from fq.workflow.encode import BlockJob

    jobs = []
    for b in range(blocks):
        ids = [b * experts + e for e in range(experts)]
        frag = out / "fragments" / NODE / fragment_filename(NODE, LAYER, b)
        jobs.append(BlockJob(node=NODE, role="base", K=K, codebook=codebook, node_digest="3" * 64, layer=LAYER, block=b,
                             experts=ids, sources={str(x): {p: [str(shard), names[e][p]] for p in SHAPES}
                                                   for e, x in zip(range(experts), ids)},
                             ancestors=[], out_fragment=str(frag),
                             out_metrics=str(out / "metrics" / NODE / f"{frag.stem}.json")))
    return jobs


def run_mode(mode: str, work: Path, *, campaign: Path, key: Path, shard: Path, names: dict, blocks: int, experts: int,
             K: int, codebook: str, device: str, devices: list[int], threads: int, fixed_s: float) -> dict:
    from fq.model.experts import STANDARD
    from fq.workflow.encode import encode_blocks

    out = work / mode
    jobs = block_jobs(out, blocks, experts, shard, names, K, codebook)
    groups = [[j] for j in jobs] if mode == "block" else [jobs]
    rows = []
    for n, group in enumerate(groups):
        tl: dict = {}
        # a lock directory per job: each job claims a GPU by an flock, and this process never releases one
        encode_blocks(group, campaign_json=str(campaign), key_path=str(key), device=device, devices_list=devices,
                      lock_dir=str(out / f"locks-{n}"), seed=0, layout=STANDARD, threads=threads, timeline=tl)
        busy = sum(b["encode_s"] for b in tl["blocks"])
        rest = tl["wall_s"] - busy
        rows.append({"job": n, "blocks": len(group), "wall_s": tl["wall_s"], "busy_s": busy, "rest_s": rest,
                     "setup_s": tl["setup_s"], "final_write_wait_s": tl.get("final_write_wait_s", 0.0),
                     "fixed_s": fixed_s, "share": (rest + fixed_s) / busy if busy else None, "per_block": tl["blocks"]})
    busy = sum(r["busy_s"] for r in rows)
    outside = sum(r["rest_s"] + r["fixed_s"] for r in rows)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "fragments").rglob("*.safetensors"))}
    return {"per_job": mode, "jobs": rows, "busy_s": busy, "outside_s": outside,
            "share": outside / busy if busy else None, "fragments": digests}


def measure(*, experts: int = 32, blocks: int = 4, scale: int = 1, K: int = 2, codebook: str = "mul1",
            device: str = "cpu", devices: list[int] | None = None, threads: int = 0, process_reps: int = 3,
            modes=("block", "layer"), tmp: str | None = None, log=print) -> dict:
    from fq.codec import encode

    if scale < 1 or any((d // scale) % 128 or d % scale for shape in SHAPES.values() for d in shape):
        raise SystemExit(f"--scale {scale}: every dimension divided by it must stay a multiple of 128 (1, 2, 4, 8, 16)")
    devices = list(devices or ([0] if device == "cuda" else []))
    kind = "cpu" if device == "cpu" else "cuda"
    torch_dev = "cpu" if device == "cpu" else f"cuda:{devices[0]}"
    res: dict = {"experts": experts, "blocks": blocks, "scale": scale, "K": K, "codebook": codebook, "device": device,
                 "shapes": {p: [o // scale, i // scale] for p, (o, i) in SHAPES.items()}, "threads": threads,
                 "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(devices[0]) if kind == "cuda" else None}}
    if threads:
        torch.set_num_threads(threads)
    # warm-up: this process's own first call (and, on a fresh machine, the CUDA kernel's build into its cache, which
    # the fresh processes below must not pay)
    encode(torch.randn(128, 128), K, codebook, 0, torch_dev)
    res["process"] = proc = fresh_process(torch_dev, K, codebook, process_reps)
    fixed = proc["python_start_s"] + proc["imports_s"] + proc["first_call_s"]
    log(f"fresh process: start {proc['python_start_s']:.2f} s, imports {proc['imports_s']:.2f} s, first encode call "
        f"{proc['first_call_s']:.2f} s: {fixed:.2f} s per job")
    work = Path(tempfile.mkdtemp(prefix="fq-encode-job-", dir=tmp))
    try:
        shard, names = make_source(work, experts, scale)
        campaign, key = make_campaign(work, kind, experts, shard)
        res["source_bytes_per_block"] = shard.stat().st_size
        res["modes"] = []
        for mode in modes:
            r = run_mode(mode, work, campaign=campaign, key=key, shard=shard, names=names, blocks=blocks,
                         experts=experts, K=K, codebook=codebook, device=device, devices=devices, threads=threads,
                         fixed_s=fixed)
            res["modes"].append(r)
            shutil.rmtree(work / mode, ignore_errors=True)
        fr = [m.pop("fragments") for m in res["modes"]]
        res["identical_fragments"] = all(f == fr[0] for f in fr) and len(fr[0]) == blocks
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def table(res: dict) -> str:
    lines = [f"{res['blocks']} blocks of {res['experts']} experts, shapes {res['shapes']}, K={res['K']} "
             f"{res['codebook']}, device {res['device']}" + (f" ({res['host']['gpu']})" if res['host']['gpu'] else ""),
             "", "| per_job | job | blocks | wall s | busy s | rest s | + process/first call s | share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in res["modes"]:
        for j in m["jobs"]:
            lines.append(f"| {m['per_job']} | {j['job']} | {j['blocks']} | {j['wall_s']:.3f} | {j['busy_s']:.3f} | "
                         f"{j['rest_s']:.3f} | {j['fixed_s']:.3f} | {j['share']:.4f} |")
        lines.append(f"| {m['per_job']} | all | {sum(j['blocks'] for j in m['jobs'])} | "
                     f"{sum(j['wall_s'] for j in m['jobs']):.3f} | {m['busy_s']:.3f} | "
                     f"{sum(j['rest_s'] for j in m['jobs']):.3f} | {sum(j['fixed_s'] for j in m['jobs']):.3f} | "
                     f"**{m['share']:.4f}** |")
    lines += ["", "| per_job | block | encoder s | waiting for reader s | waiting for writer s | encoded at s | "
                  "committed at s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in res["modes"]:
        for j in m["jobs"]:
            for b in j["per_block"]:
                lines.append(f"| {m['per_job']} | {b['block']} | {b['encode_s']:.3f} | {b['read_wait_s']:.3f} | "
                             f"{b['write_wait_s']:.3f} | {b.get('encoded_s', 0):.3f} | {b.get('committed_s', 0):.3f} |")
    lines.append(f"\nfragments byte-identical across modes: {res['identical_fragments']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32, help="experts per block (GLM-5 campaigns: 32)")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of the layer (GLM-5: 8 of 32 experts)")
    ap.add_argument("--scale", type=int, default=1, help="divide every matrix dimension by this (CPU smoke runs)")
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--devices", type=int, nargs="*", default=None, help="CUDA device index (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--process-reps", type=int, default=3)
    ap.add_argument("--modes", default="block,layer")
    ap.add_argument("--json")
    ap.add_argument("--tmp", help="directory for the synthetic shard and the fragments (default: the system's)")
    a = ap.parse_args(argv)
    res = measure(experts=a.experts, blocks=a.blocks, scale=a.scale, K=a.K, codebook=a.codebook, device=a.device,
                  devices=a.devices, threads=a.threads, process_reps=a.process_reps, modes=tuple(a.modes.split(",")),
                  tmp=a.tmp)
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["identical_fragments"] else 1


if __name__ == "__main__":
    sys.exit(main())
