"""The release gate: may the GPU fleet be released, so that finalize runs later on a CPU box?

Finalize needs, on whatever machine runs it next: the campaign directory (campaign.json, every
committed fragment and skeleton, the lock files), the signer key, the recipe, the config files, the
source metadata the Snakefile plans from (local: the checkpoint directory; hub: ``OUT/meta``, written
by init), the workflow (Snakefile, rules, scripts), fq itself, and the ``fq`` and ``snakemake``
executables. The gate checks that each exists and lives on the campaign's filesystem (``st_dev`` of
the path, symlinks followed, equal to the campaign directory's), that no launcher or worker (orphans
included) is still running, and that every planned fragment and skeleton shard is committed.

What it cannot check: whether that filesystem survives the release. A persistent volume and an
instance disk mounted at the same path look the same from inside the machine; only the operator
(and the provider's console) can tell. The gate prints the mount point and says so every time.

``rehearsal``: a rehearsal runs finalize on this same machine, so "not on the campaign's volume"
becomes a warning there. Everything else -- a missing file, a missing tool, a running worker, an
uncommitted block -- fails in both modes, because it would fail finalize on this machine too.
Exit codes (fq gate): 0 release, 1 checks failed, 2 usage.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import fq
from fq.errors import FqError

OK, WARN, FAIL, NOTE = "ok", "warn", "FAIL", "note"
TOOLS = ("fq", "snakemake")


@dataclass
class GateReport:
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (status, what, detail)
    rehearsal: bool = False

    def add(self, status: str, what: str, detail: str) -> None:
        self.lines.append((status, what, detail))

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        return [l for l in self.lines if l[0] == FAIL]

    def render(self) -> str:
        w = max((len(what) for _, what, _ in self.lines), default=0)
        return "\n".join(f"  {status:<5} {what:<{w}}  {detail}" for status, what, detail in self.lines)


def _dev(path: Path) -> int:
    return os.stat(path).st_dev


def _devname(dev: int) -> str:
    return f"{os.major(dev)}:{os.minor(dev)}"


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the filesystem holding ``path`` (from /proc/self/mounts)."""
    real = os.path.realpath(path)
    best, fstype = "/", "?"
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return best, fstype


class Gate:
    def __init__(self, out: Path, rehearsal: bool):
        self.out = out
        self.report = GateReport(rehearsal=rehearsal)
        self.dev = _dev(out)
        self.mount, self.fstype = mount_of(out)

    def on_volume(self, what: str, path: Path | str | None, *, required: bool = True, missing_hint: str = "") -> bool:
        """Exists, and on the campaign's filesystem (a warning only in a rehearsal). Returns whether it exists
        (so that what can be checked about its content still is)."""
        if path is None:
            self.report.add(FAIL, what, f"not configured{missing_hint}")
            return False
        p = Path(path)
        if not p.exists():
            if required:
                self.report.add(FAIL, what, f"{p}: missing{missing_hint}")
            else:
                self.report.add(NOTE, what, f"{p}: absent (optional)")
            return False
        dev = _dev(p)
        if dev != self.dev:
            mnt, fstype = mount_of(p)
            status = WARN if self.report.rehearsal else FAIL
            self.report.add(status, what, f"{os.path.abspath(p)}: on {mnt} ({fstype}, device {_devname(dev)}), not on the campaign's "
                                          f"filesystem {self.mount} (device {_devname(self.dev)}): it will not be "
                                          f"there after the release" + (" (rehearsal: waived)" if status == WARN else ""))
            return True
        self.report.add(OK, what, os.path.abspath(p))
        return True


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(snakefile: Path, configfiles: list[Path]) -> dict:
    """The config Snakemake would see: the workflow's config/config.yaml, then each --configfile over it."""
    import yaml

    from fq.workflow.campaign import normalize_config

    cfg: dict = {}
    for path in [snakefile.parent / "config" / "config.yaml", *configfiles]:
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise FqError(f"{path}: cannot read: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise FqError(f"{path}: not YAML: {e}") from None
        if not isinstance(doc, dict):
            raise FqError(f"{path}: expected a mapping of config keys")
        cfg = _merge(cfg, doc)
    normalize_config(cfg)
    try:
        import jsonschema

        schema = yaml.safe_load((snakefile.parent / "config" / "schemas" / "config.schema.yaml").read_text())
        jsonschema.validate(cfg, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "(top level)"
        raise FqError(f"config: {where}: {e.message}") from None
    return cfg


def _interpreter(script: Path) -> Path | None:
    try:
        with open(script, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return Path(parts[0]) if parts else None


def run_gate(snakefile: Path, configfiles: list[Path], rehearsal: bool) -> GateReport:
    """Every check, in order; never stops at the first failure (the operator fixes them all at once)."""
    from fq.workflow import locks

    cfg = load_config(snakefile, configfiles)
    out = Path(cfg["out"])
    if not out.is_dir():
        raise FqError(f"campaign directory {out}: missing (out: in the config, relative to the working directory "
                      f"{os.getcwd()}); run the gate where you run snakemake, with the same --configfile")
    g = Gate(out, rehearsal)
    r = g.report
    r.add(NOTE, "campaign filesystem", f"{g.mount} ({g.fstype}, device {_devname(g.dev)}); this gate can only check "
                                       f"that everything is on it: it cannot tell a persistent volume from an "
                                       f"instance disk mounted at the same path. Confirm with your provider that "
                                       f"{g.mount} survives the release")
    if g.mount == "/":
        r.add(WARN, "campaign filesystem", "the campaign is on the root filesystem, which on most rentals is the "
                                           "instance's own disk: make sure this one is persistent")
    g.on_volume("campaign directory", out)
    g.on_volume("campaign.json", out / "campaign.json", missing_hint=" (init has not run)")
    for i, cf in enumerate(configfiles):
        g.on_volume("config file" if len(configfiles) == 1 else f"config file {i + 1}", cf)
    g.on_volume("recipe", cfg["recipe"])
    if cfg.get("usage"):
        g.on_volume("expert usage", cfg["usage"])
    key = Path(cfg.get("signer_key") or out / "keys" / "signer.key")
    if g.on_volume("signer key", key):
        _check_key(r, key, out / "campaign.json")
    g.on_volume("signer.pub", out / "signer.pub", missing_hint=" (init writes it)")
    _check_source(g, cfg, out)
    _check_software(g, snakefile)
    _check_processes(r, out, locks)
    _check_committed(r, cfg)
    return r


def _check_key(r: GateReport, key: Path, campaign_json: Path) -> None:
    from fq.core import canonical
    from fq.provenance.attest import keys

    if not campaign_json.is_file():
        return
    try:
        fp = keys.fingerprint(keys.load_private(key))
    except FqError as e:
        r.add(FAIL, "signer key", str(e))
        return
    bound = canonical.load(campaign_json)["identity"]["signer"]
    if fp != bound:
        r.add(FAIL, "signer key", f"{key}: fingerprint {fp[:16]}… is not the campaign's bound signer {bound[:16]}…")


def _check_source(g: Gate, cfg: dict, out: Path) -> None:
    from fq.workflow.common import INDEX, SIDE_FILES

    kind = cfg["source"]["kind"]
    if kind == "demo":
        d = out / "demo-model"
        g.on_volume("source metadata", d / "config.json", missing_hint=" (the demo_model rule writes it)")
        return
    if kind == "hub":
        from fq.workflow.hub import META_DOC

        d = out / "meta"
        hint = " (init stores the hub metadata there; run snakemake to bring init up to date)"
        for name in ("config.json", INDEX, META_DOC):
            g.on_volume(f"source metadata {name}", d / name, missing_hint=hint)
        return
    d = Path(cfg["source"]["path"])
    hint = " (the Snakefile plans from the local checkpoint: it must stay readable after the release)"
    if not g.on_volume("source checkpoint", d, missing_hint=hint):
        return
    for name in ("config.json", INDEX):
        g.on_volume(f"source metadata {name}", d / name, missing_hint=hint)
    try:
        from fq.core import canonical

        shards = sorted(set(canonical.load(d / INDEX)["weight_map"].values()))
    except (FqError, KeyError, TypeError, AttributeError) as e:
        g.report.add(FAIL, "source index", f"{d / INDEX}: unreadable ({e})")
        return
    bad = [s for s in shards if not (d / s).is_file() or _dev(d / s) != g.dev]
    if bad:
        status = WARN if g.report.rehearsal and all((d / s).is_file() for s in bad) else FAIL
        g.report.add(status, "source shards", f"{len(bad)} of {len(shards)} shards missing or not on the campaign's "
                                              f"filesystem (the Snakefile sizes them at parse time): {', '.join(bad[:5])}"
                                              + (" …" if len(bad) > 5 else ""))
    else:
        g.report.add(OK, "source shards", f"{len(shards)} shards in {d}")
    for side in SIDE_FILES:
        if side != "config.json" and (d / side).exists():
            g.on_volume(f"source {side}", d / side)


def _check_software(g: Gate, snakefile: Path) -> None:
    g.on_volume("workflow Snakefile", snakefile)
    for sub in ("rules", "scripts", "config"):
        g.on_volume(f"workflow {sub}/", snakefile.parent / sub)
    g.on_volume("fq package", Path(fq.__file__).resolve().parent)
    for tool in TOOLS:
        where = shutil.which(tool)
        if where is None:
            g.report.add(FAIL, f"tool {tool}", f"{tool}: not found on PATH ({os.environ.get('PATH', '')}); finalize "
                                               f"needs it: activate the campaign's environment (make install) and rerun")
            continue
        if g.on_volume(f"tool {tool}", Path(where)):
            interp = _interpreter(Path(where))
            if interp is not None and interp.exists() and _dev(interp.resolve()) != g.dev:
                g.report.add(WARN, f"tool {tool}", f"its interpreter {interp} resolves to {interp.resolve()} on "
                                                   f"{mount_of(interp.resolve())[0]}: the next machine must provide it "
                                                   f"(same image, or a venv with --copies)")
            elif interp is not None and not interp.exists():
                g.report.add(FAIL, f"tool {tool}", f"{where}: its interpreter {interp} does not exist")


def _check_processes(r: GateReport, out: Path, locks) -> None:
    lock_dir = locks.lock_dir(out)
    camp = lock_dir / locks.CAMPAIGN
    if camp.exists() and locks.is_held(camp):
        r.add(FAIL, "launcher", f"a Snakemake run still holds {camp}: wait for it to finish (or stop it with one "
                                f"SIGINT and wait) before releasing the machines it runs on")
        return
    workers = lock_dir / locks.WORKERS
    # no launcher is alive, so no new worker is starting: probing the workers lock cannot refuse a live job
    if workers.exists() and locks.is_held(workers):
        r.add(FAIL, "workers", f"encode workers (possibly orphans of a killed Snakemake) still hold {workers}: "
                               f"`fuser -v {workers}` names them; wait until they exit")
        return
    r.add(OK, "processes", "no launcher and no worker is running on this campaign")


def _check_committed(r: GateReport, cfg: dict) -> None:
    from fq.workflow.campaign import load_campaign

    try:
        c = load_campaign(cfg)
    except FqError as e:
        r.add(FAIL, "plan", f"the campaign cannot be planned from its config here: {e}")
        return
    expected = c.committed_files()
    missing = [p for p in expected if not Path(p).is_file()]
    if missing:
        r.add(FAIL, "committed work", f"{len(missing)} of {len(expected)} planned fragment/skeleton files are not "
                                      f"committed (the GPU work is not done): {', '.join(missing[:5])}"
                                      + (" …" if len(missing) > 5 else "") + "; run snakemake until it completes")
    else:
        r.add(OK, "committed work", f"{len(c.fragments)} fragments and {len(c.skeleton_shards)} skeleton shards, "
                                    f"each with its attestation")


def main_report(rep: GateReport, out=None) -> int:
    out = out or sys.stdout
    print(rep.render(), file=out)
    fails = rep.failed
    warns = [l for l in rep.lines if l[0] == WARN]
    if fails:
        print(f"fq gate: {len(fails)} check(s) failed: do NOT release the GPU fleet "
              f"({', '.join(sorted({what for _, what, _ in fails}))})", file=out)
        return 1
    tail = " (rehearsal: survivability waived)" if rep.rehearsal else ""
    print(f"fq gate: all checks passed{tail}; {len(warns)} warning(s). Release the GPU fleet, then finalize "
          f"on the machine that mounts the campaign's filesystem", file=out)
    return 0
