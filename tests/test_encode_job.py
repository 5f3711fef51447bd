"""fq.workflow.encode.encode_blocks, the function every encode job runs (per_job block: one block; layer: all of a
layer's blocks): the same bytes either way, I/O overlapped with the encoder by one reader and one writer thread,
errors of either thread failing the job with their own message; and benchmarks/encode_job.py, smoked on the CPU.

The data is benchmarks/encode_job.py's synthetic block, one expert a block, its three matrices 128x128 (the smallest
EXL3 geometry: the encoder's fixed costs dominate, a few tenths of a second each on the CPU).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import encode_job as bench  # noqa: E402
from fq.errors import FqError  # noqa: E402
from fq.hessian import store  # noqa: E402
from fq.model.experts import STANDARD  # noqa: E402
from fq.workflow import encode as enc  # noqa: E402


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return bench.small_campaign(tmp_path_factory.mktemp("synth"))


def jobs(synth, out: Path, blocks: int = 2):
    return bench.block_jobs(out, blocks, 1, synth["shard"], synth["names"], 2, "mul1")


def run(synth, group, lock_dir: Path, **kw):
    return enc.encode_blocks(group, campaign_json=str(synth["campaign"]), key_path=str(synth["key"]), device="cpu",
                             devices_list=[], lock_dir=str(lock_dir), seed=0, layout=STANDARD, threads=1, **kw)


def digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and "locks" not in p.parts}


def test_a_layer_job_writes_the_bytes_of_its_block_jobs(synth, tmp_path):
    a, b = tmp_path / "block", tmp_path / "layer"
    for j in jobs(synth, a):
        run(synth, [j], tmp_path / "locks-a")
    tl: dict = {}
    summaries = run(synth, jobs(synth, b), tmp_path / "locks-b", timeline=tl)
    assert [s["block"] for s in summaries] == [0, 1]
    got = digests(b)
    assert got == digests(a) and len(got) == 6  # fragment, attestation, metrics per block
    assert [x["block"] for x in tl["blocks"]] == [0, 1] and all(x["encode_s"] > 0 for x in tl["blocks"])
    assert all(x["encoded_s"] <= x["committed_s"] <= tl["wall_s"] for x in tl["blocks"])
    assert tl["blocks"][0]["committed_s"] <= tl["blocks"][1]["committed_s"]  # commits in block order


@pytest.mark.parametrize("batch_bytes", [0, 3 * 128 * 128 * 4], ids=["single", "batched"])
def test_the_reader_overlaps_the_encoder_and_the_writer_the_next_block(synth, tmp_path, monkeypatch, batch_bytes):
    """One matrix at a time (batch_bytes=0: one encoder call a matrix) and batched (one expert a batch here: one
    call for its three matrices): the next batch is read while this one encodes, a block committed while the next
    encodes."""
    events, t0 = [], time.perf_counter()

    def log(what):
        events.append((time.perf_counter() - t0, what, threading.current_thread().name))

    real_get, real_encode, real_commit = enc.read_matrix, enc.encode_group, enc._commit

    def get_source(handles, ref, where):
        log(f"read {ref.tensor}")
        return real_get(handles, ref, where)

    def encode(mats, *args):
        log("encode start")
        out = real_encode(mats, *args)
        time.sleep(0.15)  # a slow encoder: reads and commits must happen meanwhile
        log("encode end")
        return out

    def commit(b, *args, **kw):
        log(f"commit start {b.block}")
        out = real_commit(b, *args, **kw)
        log(f"commit end {b.block}")
        return out

    monkeypatch.setattr(enc, "read_matrix", get_source)
    monkeypatch.setattr(enc, "encode_group", encode)
    monkeypatch.setattr(enc, "_commit", commit)
    run(synth, jobs(synth, tmp_path / "out"), tmp_path / "locks", batch_bytes=batch_bytes)
    what = [e[1] for e in events]
    threads = {e[1].split(" ")[0]: e[2] for e in events}
    assert threads["read"] != threads["encode"] != threads["commit"] != threads["read"]
    reads = [i for i, w in enumerate(what) if w.startswith("read ")]
    ends = [i for i, w in enumerate(what) if w == "encode end"]
    calls = 3 if batch_bytes == 0 else 1  # encoder calls a block (one expert)
    assert len(reads) == 6 and len(ends) == 2 * calls  # 2 blocks x 3 matrices
    # block 1's source (the 4th read) is read while block 0 still encodes its last matrix
    assert reads[3] < ends[calls - 1]
    # block 0 is committed while block 1 encodes, before block 1's last matrix is done
    assert what.index("commit end 0") < len(what) - 1 - what[::-1].index("encode end")
    assert what.index("commit start 1") > what.index("commit end 0")  # one writer, block order


def test_a_reader_error_fails_the_job_with_its_message_after_committing_the_blocks_before(synth, tmp_path):
    group = jobs(synth, tmp_path / "out", blocks=3)
    missing = tmp_path / "gone" / "model-00002-of-00002.safetensors"
    group[1].sources = {e: {p: [str(missing), n] for p, (_, n) in projs.items()} for e, projs in group[1].sources.items()}
    with pytest.raises(FqError, match=r"model-00002-of-00002.safetensors: source shard is not staged"):
        run(synth, group, tmp_path / "locks")
    assert all(Path(p).is_file() for p in group[0].outputs)
    assert not any(Path(p).exists() for j in group[1:] for p in j.outputs)


def test_a_writer_error_fails_the_job_with_its_message(synth, tmp_path, monkeypatch):
    real = enc.write_fragment

    def write_fragment(path, **kw):
        if kw["block"] == 0:
            raise OSError(28, f"No space left on device: {path}")
        return real(path, **kw)

    monkeypatch.setattr(enc, "write_fragment", write_fragment)
    group = jobs(synth, tmp_path / "out", blocks=3)
    with pytest.raises(OSError, match="No space left on device: .*block000"):
        run(synth, group, tmp_path / "locks")
    # the failed commit stops the job: block 2 is never committed (block 1 at most is encoded meanwhile)
    assert not any(Path(p).exists() for j in group for p in j.outputs)


def test_a_layer_job_takes_every_claim_before_it_writes(synth, tmp_path):
    from fq.workflow import locks

    group = jobs(synth, tmp_path / "out", blocks=2)
    held = locks.claim_path(tmp_path / "locks", group[1].name)
    held.parent.mkdir(parents=True)
    code = (f"import fcntl, sys, time; f = open({str(held)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(FqError, match=f"another worker holds its claim .*{group[1].name}"):
            run(synth, group, tmp_path / "locks")
        assert not any(Path(p).exists() for j in group for p in j.outputs)  # refused before block 0 was written
    finally:
        other.communicate("")


@pytest.mark.slow
def test_encode_job_benchmark_smoke(tmp_path):
    out = tmp_path / "job.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "encode_job.py"), "--device", "cpu", "--experts", "1",
                        "--blocks", "2", "--scale", "16", "--process-reps", "1", "--threads", "1", "--json", str(out),
                        "--tmp", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["identical_fragments"] is True
    by = {m["per_job"]: m for m in d["modes"]}
    assert [j["blocks"] for j in by["block"]["jobs"]] == [1, 1] and [j["blocks"] for j in by["layer"]["jobs"]] == [2]
    for m in d["modes"]:
        assert m["busy_s"] > 0 and m["share"] > 0
        assert all(len(j["per_block"]) == j["blocks"] for j in m["jobs"])
    assert d["process"]["first_call_s"] > 0 and "| layer | all | 2 |" in r.stdout


def test_gpu_pipeline_benchmark_smoke_on_cpu(tmp_path):
    """benchmarks/gpu_pipeline.py: real job processes, two at a time, their timelines and the share."""
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_pipeline.py"), "--device", "cpu", "--experts", "1",
                        "--scale", "16", "--jobs", "2", "--threads", "1", "--tmp", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["fragments"] == 2 and res["all_committed"]
    rows = res["rows"]
    assert all(r["device"] == "cpu" and r["busy_s"] > 0 and r["tail_s"] > 0 for r in rows)
    assert all(r["launch"] <= r["claimed"] <= r["first_call"] <= r["last_call_end"] <= r["done"] <= r["exit"] for r in rows)
    assert "share" in p.stdout and "first job's own start-up" in p.stdout


def test_multi_gpu_campaign_checks_flag_what_the_issue_forbids():
    """benchmarks/multi_gpu_campaign.py's verdict on nvidia-smi samples (the run itself needs GPUs)."""
    import multi_gpu_campaign as mg

    good = {"devices": [0, 1], "gpus": [0, 1, 2], "claims": {"encode/a.log": ["cuda:0"], "encode/b.log": ["cuda:1"]},
            "samples": [{"t": 0.0, "apps": [(0, 10), (1, 11)], "util": {0: 50, 1: 40, 2: 0}},
                        {"t": 0.25, "apps": [(0, 12)], "util": {0: 60, 1: 0, 2: 0}}]}
    c = mg.check(good)
    assert c["every_configured_gpu_used"] and not c["two_on_one_gpu"] and not c["on_unconfigured_gpu"]
    assert c["gpus"][0]["processes"] == 2 and c["gpus"][2]["samples_busy"] == 0
    bad = dict(good, samples=good["samples"] + [{"t": 0.5, "apps": [(0, 12), (0, 13), (2, 14)], "util": {}}])
    c = mg.check(bad)
    assert [d["gpu"] for d in c["two_on_one_gpu"]] == [0] and [d["gpu"] for d in c["on_unconfigured_gpu"]] == [2]
    idle = dict(good, samples=[good["samples"][1]], claims={"encode/a.log": ["cuda:0"]})
    assert not mg.check(idle)["every_configured_gpu_used"]  # GPU 1 configured but never used


# ------------------------------------------------------------------------- batched encodes: the bytes of one at a time

class _FakeHessians:
    """A layer's Hessians as calibration.bound_hessians returns them: the block input's H (gate/up) and one per
    expert (down), symmetric positive definite, fixed by a seed; unweighted (calibration.weighting none)."""

    weighting = "none"

    def __init__(self, n_in: int, n_mid: int):
        import torch

        def spd(n, seed):
            x = torch.randn(4 * n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            return x.t() @ x / (4 * n)

        self._input, self._spd, self._mid = spd(n_in, 1), spd, n_mid

    def input(self):
        return self._input

    def down(self, e):
        return self._spd(self._mid, 100 + e)


def _stage_jobs(base: list, out: Path, K) -> list:
    """A stage (node s1) over ``base``'s committed fragments, block for block."""
    from fq.provenance.fragments import fragment_filename

    jobs_ = []
    for b in base:
        frag = out / "fragments" / "s1" / fragment_filename("s1", b.layer, b.block)
        jobs_.append(enc.BlockJob(node="s1", role="stage", K=K, codebook="mul1", node_digest="4" * 64, layer=b.layer,
                                  block=b.block, experts=b.experts, sources=b.sources, hessian=b.hessian,
                                  ancestors=[{"node": b.node, "codebook": b.codebook, "digest": b.node_digest,
                                              "path": b.out_fragment}], out_fragment=str(frag),
                                  out_metrics=str(out / "metrics" / "s1" / f"{frag.stem}.json")))
    return jobs_


@pytest.mark.parametrize("calibrated", [False, True], ids=["weight-only", "ldlq"])
def test_batched_encodes_write_the_bytes_of_one_matrix_at_a_time(synth, tmp_path, monkeypatch, calibrated):
    """A base (one block of two experts: one batch of 6 matrices; per-projection K: two groups)
    and a stage on it, batched (the default) and one matrix at a time (batch_bytes=0): the same fragments,
    attestations and metrics, byte for byte. LDLQ: gate/up share the layer's input H, each down its expert's."""
    monkeypatch.setattr(enc.calibration, "bound_hessians", lambda path, binding, layer, weighting="none": (
        _FakeHessians(128, 128), {"file": store.file_name(layer), "sha256": "5" * 64, "calibration": "6" * 64,
                                  "capture": store.MODES[0]}))
    calls = []
    real_ldlq, real_wo = enc.encode_ldlq_batch, enc.encode_batch
    monkeypatch.setattr(enc, "encode_ldlq_batch", lambda Ws, *a, **k: calls.append(len(Ws)) or real_ldlq(Ws, *a, **k))
    monkeypatch.setattr(enc, "encode_batch", lambda Ws, *a, **k: calls.append(len(Ws)) or real_wo(Ws, *a, **k))
    K = {"gate": 2, "up": 2, "down": 3}
    out = {}
    for mode, batch_bytes in (("single", 0), ("batched", None)):
        o = tmp_path / mode
        base = bench.block_jobs(o, 1, 2, synth["shard"], synth["names"], K, "mul1")
        for b in base:
            b.hessian = {"path": "h", "binding": "b"} if calibrated else None
        for group in (base, _stage_jobs(base, o, 2)):
            enc.encode_blocks(group, campaign_json=str(synth["campaign"]), key_path=str(synth["key"]), device="cpu",
                              devices_list=[], lock_dir=str(o / "locks"), seed=0, layout=STANDARD, threads=1,
                              batch_bytes=batch_bytes)
        out[mode] = digests(o)
    assert len(out["single"]) == 6  # 2 nodes x 1 block x (fragment, attestation, metrics)
    assert out["batched"] == out["single"]
    # batched: the base's 4 gate/up matrices of both experts (K2) in one call, its 2 downs (K3) in another; the
    # stage's 6 (all K2; LDLQ: the input H shared by 4, one per expert for the downs) in one
    assert calls == [4, 2, 6]
