"""Helpers of the crash-safety tests: a tiny local checkpoint (so a whole campaign encodes in seconds on
two CPU cores), its config, Snakemake launched as a real process group, and process inspection."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
HIDDEN = INTER = 128  # the smallest EXL3 geometry: one 128x128 matrix is 64 trellis tiles
N_EXPERTS = 2
LAYERS = 3  # layer 0 dense, layers 1-2 MoE

# One K3 base and one K3 stage over one expert per layer: four encode jobs of block size 2.
RECIPE = {
    "format": "fq-cartridge/2", "name": "crash", "description": "crash tests (K3 encodes fastest on the CPU)",
    "nodes": [
        {"name": "a", "kind": "base", "K": 3, "codebook": "mul1"},
        {"name": "a.r1", "kind": "stage", "K": 3, "codebook": "mul1", "parent": "a",
         "experts": {"layers": {"1": [1], "2": [0]}}},
    ],
    "products": [{"name": "a", "chain": ["a"]}, {"name": "a.r1", "chain": ["a", "a.r1"]}],
}


def _shard_of(name: str) -> int:
    """1: every non-expert tensor (one skeleton job); 2: layer 1's experts; 3: layer 2's experts."""
    if ".mlp.experts." not in name:
        return 1
    return int(name.split(".")[2]) + 1


def tiny_checkpoint(d: Path, seed: int = 7) -> Path:
    """A DeepSeek-layout MoE checkpoint with 128x128 experts: config.json, the index and four shards."""
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def w(o, i):
        x = torch.randn(o, i, generator=g)
        return (x * x.abs().pow(0.5) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(256, HIDDEN), "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
         "lm_head.weight": w(256, HIDDEN)}
    for L in range(LAYERS):
        p = f"model.layers.{L}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        t[f"{p}.self_attn.o_proj.weight"] = w(HIDDEN, HIDDEN)
        if L == 0:
            for proj in ("gate", "up"):
                t[f"{p}.mlp.{proj}_proj.weight"] = w(INTER, HIDDEN)
            t[f"{p}.mlp.down_proj.weight"] = w(HIDDEN, INTER)
            continue
        t[f"{p}.mlp.gate.weight"] = w(N_EXPERTS, HIDDEN)
        for e in range(N_EXPERTS):
            for proj in ("gate", "up"):
                t[f"{p}.mlp.experts.{e}.{proj}_proj.weight"] = w(INTER, HIDDEN)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = w(HIDDEN, INTER)
    shards = {i: {} for i in range(1, 4)}
    for name, x in t.items():
        shards[_shard_of(name)][name] = x
    names = {i: f"model-{i:05d}-of-00003.safetensors" for i in shards}
    for i, ts in shards.items():
        save_file(ts, str(d / names[i]), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(x.numel() * 2 for x in t.values())},
             "weight_map": {n: names[_shard_of(n)] for n in sorted(t)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "moe_intermediate_size": INTER, "n_routed_experts": N_EXPERTS,
              "n_shared_experts": 0, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
              "num_hidden_layers": LAYERS, "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 256,
              "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return d


def write_config(d: Path, source: Path, key: Path | None = None, *, out: str = "campaign", **over) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "recipe.json").write_text(json.dumps(RECIPE))
    cfg = {"campaign": "crash", "out": out, "source": {"kind": "local", "path": str(source), "revision": "tiny-1"},
           "recipe": str(d / "recipe.json"), "block_size": 2, "windows": "1,2", "windows_on_disk": 1,
           "signer_key": str(key) if key else None,
           "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0}, "compare_native": False, "eval": None,
           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"},
           "allow_unloadable": True,  # a DeepseekV3 config without MLA: what it tests is the campaign, not a runtime
           **over}
    path = d / "config.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
    return path


def keygen(prefix: Path) -> Path:
    from fq.provenance.attest import keys

    prefix.parent.mkdir(parents=True, exist_ok=True)
    keys.generate(str(prefix))
    return Path(f"{prefix}.key")


def env() -> dict:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def smk_cmd(d: Path, *args) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(d),
            "--configfile", str(d / "config.yaml"), "--cores", "2", *args]


# What the tests ask for: the published, verified campaign (the report is not what these tests are about).
TARGETS = ("campaign/campaign_summary.json", "campaign/published.verified")


def smk(d: Path, *args, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(smk_cmd(d, *args), capture_output=True, text=True, env=env(), timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def start(d: Path, *args, log: Path | None = None) -> subprocess.Popen:
    """Snakemake in its own session (process group = its pid), as an operator's terminal would run it."""
    out = open(log or (d / "launcher.log"), "ab")
    return subprocess.Popen(smk_cmd(d, *args), stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True)


def killpg(p: subprocess.Popen) -> None:
    """SIGKILL the whole process group: the launcher and every job it started (a preemption)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    # jobs of the group die with it, but let the kernel finish reaping them before we look again
    deadline = time.monotonic() + 10
    while group_pids(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running_scripts(pgid: int) -> dict[int, str]:
    """pid -> rule script name ('encode', 'finalize', ...) of the job processes in the group."""
    out = {}
    for pid in group_pids(pgid):
        cmd = cmdline(pid)
        if "python" in cmd and ".snakemake/scripts/" in cmd:
            out[pid] = cmd.rsplit(".", 2)[-2] if cmd.rstrip().endswith(".py") else cmd
    return out


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def flock_holders(path: str | os.PathLike) -> list[tuple[int, str]]:
    """(pid, READ|WRITE) of every flock held on ``path``, from /proc/locks: looking never takes the lock."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    with open("/proc/locks") as fh:
        for line in fh:
            parts = [p for p in line.split()[1:] if p != "->"]
            if len(parts) >= 5 and parts[0] == "FLOCK" and parts[4] == dev and "->" not in line:
                out.append((int(parts[3]), parts[2]))
    return out


def alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_for(cond, timeout: float = 120, what: str = "condition", poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def holder(code: str) -> subprocess.Popen:
    """A separate process that runs ``code`` (taking some fq.workflow.locks), says 'held', and keeps its locks
    until its stdin closes (release) or it is killed."""
    script = textwrap.dedent(f"""
        import sys
        from fq.workflow import locks
        {code}
        print("held", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def release(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=30)


@contextlib.contextmanager
def mounted_tmpfs(path, size, what: str = "a tmpfs", needs: str = ""):
    """A tmpfs of ``size`` (mount's size=: "64k" or bytes) on the existing directory ``path`` for the with-block,
    lazily unmounted after; skips the test where it cannot be mounted (it needs root)."""
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount {what} here ({m.stderr.strip() or m.returncode}){needs}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
