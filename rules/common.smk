# Helpers shared by the rules: the campaign is planned here, at parse time, from metadata alone.
import hashlib
import re
import sys
from pathlib import Path

from fq.model.demo_model import SIDE_FILES as DEMO_SIDE_FILES, TEXT_SPLITS as DEMO_TEXT_SPLITS
from fq.provenance.publication import NAME as PUBLICATION_NAME
from fq.errors import FqError
from fq.workflow.campaign import load_campaign
from fq.workflow.common import INDEX, SUMMARY
from fq.workflow.launch import on_parse, on_start

try:
    C = load_campaign(config)
except FqError as e:  # a refused source, recipe or config: fq's one line, not a traceback through the Snakefile
    sys.exit(f"fq: {e}")
# The launcher lock (fq.workflow.launch), taken here, before Snakemake builds its DAG, by the process the user started
# when it will run jobs; a second launcher on this campaign stops here, with fq's one line. Not in the jobs that
# re-parse this file, and not for -n, --lint, --list and the other commands that run no job.
LAUNCH_LOCK = on_parse(C, workflow.is_main_process)
OUT = str(C.out)
W = C.plan.windows_on_disk
KEY = config.get("signer_key") or f"{OUT}/keys/signer.key"


wildcard_constraints:
    node=r"[A-Za-z0-9][A-Za-z0-9_.+=@-]*",
    layer=r"\d{3}",
    block=r"\d{3}",
    shard=r"[^/]+\.safetensors",
    window=r"\d+",
    K=r"\d",
    codebook=r"3inst|mcg|mul1",


def fragment_of(wc):
    return C.fragment_of(wc.node, int(wc.layer), int(wc.block))


def staged_shards(block):
    return [C.staged(s) for s in block.shards]


def source_files():
    """The source shards init hashes (demo: written by the demo_model rule)."""
    return [str(C.source_dir / s) for s in C.source.shards] if C.source_kind != "hub" else []


def encode_inputs(wc):
    """A block job's (per_job: block) or a layer job's (per_job: layer) inputs: every block's ancestors, and the
    staged shards only when the job will encode (see fragment_needs_source / Campaign.layer_needs_source)."""
    layer = int(wc.layer)
    frags = [fragment_of(wc)] if "block" in wc.keys() else C.layer_fragments(wc.node, layer)
    # campaign.json and the key are ancient(): their existence matters, not their age (init refuses a
    # changed identity itself), so re-running init never cascades into re-encoding the campaign
    inputs = {
        "campaign": ancient(C.campaign_json),
        "key": ancient(KEY),
        "ancestors": [C.fragment(a, f.block) for f in frags for a in C.ancestors(wc.node)],
    }
    if C.usage_file and C.reads_usage(wc.node):
        inputs["usage"] = ancient(C.usage_file)  # a hot stage encodes the experts the measurement ranks first
    if "block" in wc.keys():
        needs = C.fragment_needs_source(wc.node, frags[0].block)
    else:
        needs = C.layer_needs_source(wc.node, layer)
    if needs:  # the Hessian too only then: a re-captured Hessian (same bytes: the binding) re-encodes nothing
        inputs["shards"] = sorted({s for f in frags for s in staged_shards(f.block)})
        inputs.update(hessian_inputs(layer))
    return inputs


# -- calibration (rules/calibrate.smk) ------------------------------------------------------------------------
def calib_will_run(layer):
    """Whether the chain's job for ``layer`` (None: embed) will run: a kept output of it is missing, or the next
    job will run and this job's hidden states (temp, deleted once read) are gone."""
    chain = [None, *C.calib.chain_layers]
    if not all(Path(p).is_file() for p in C.calib.outputs(layer)[1:]):
        return True
    i = chain.index(layer)
    return i + 1 < len(chain) and calib_will_run(chain[i + 1]) and not Path(C.calib.hidden(layer)).is_file()


def calib_staged(layer):
    """The staged shards a chain job reads and their range indexes (the job reads only its tensors' bytes, each
    checked against its shard's index), asked for only when it will run (as skeleton_inputs: a finished chain never
    makes Snakemake stage a retired window again)."""
    if not calib_will_run(layer):
        return {"shards": [], "ranges": []}
    shards = C.calib.shards(layer)
    return {"shards": [ancient(C.staged(s)) for s in shards], "ranges": [ancient(C.staged_index(s)) for s in shards]}


def calib_embed_inputs(wc):
    return {"campaign": ancient(C.campaign_json), "tokens": ancient(C.calib.tokens), **calib_staged(None)}


def calib_layer_inputs(wc):
    layer = int(wc.layer)
    return {"campaign": ancient(C.campaign_json), "hidden": C.calib.hidden(layer - 1 if layer else None),
            **calib_staged(layer)}


def calib_layer_rules():
    """The chain's layer rules, one per output set: (MoE Hessian or not) x (linear Hessians or not), each with the
    layers it serves. Names: calib_dense, calib_moe, calib_dense_linears, calib_moe_linears."""
    out = []
    for moe in (False, True):
        for lin in (False, True):
            layers = [l for l in C.calib.chain_layers
                      if (l in C.calib.calibrated_layers) == moe and (l in C.calib.linear_capture) == lin]
            if not layers:
                continue
            outputs = {"hidden": temp(f"{OUT}/calibration/hidden-layer{{layer}}.safetensors")}
            if moe:
                outputs["hessian"] = f"{OUT}/calibration/hessian-layer{{layer}}.safetensors"
            if lin:
                outputs["linears"] = f"{OUT}/calibration/linears-layer{{layer}}.safetensors"
            outputs["record"] = f"{OUT}/calibration/layer{{layer}}.json"
            name = "calib_" + ("moe" if moe else "dense") + ("_linears" if lin else "")
            out.append({"name": name, "outputs": outputs, "layers": "|".join(f"{l:03d}" for l in layers)})
    return out


CALIB_LAYER_PARAMS = {
    "source_dir": str(C.source_dir),
    "staging": f"{OUT}/staging",
    "layer": lambda wc: int(wc.layer),
    "binding": lambda wc: (C.calib.hessian_binding(int(wc.layer)) if int(wc.layer) in C.calib.calibrated_layers
                           else None),
    "capture": (C.calib.settings or {}).get("capture"),
    # the expert Hessians' router-affinity weighting: a param only when set, so that a campaign without it keeps the
    # params Snakemake recorded for its calibration jobs (and reruns none of them)
    **({"weighting": C.calib.settings["weighting"]}
       if C.calib.settings and C.calib.settings["weighting"] != "none" else {}),
    "linears": lambda wc: list(C.calib.linear_capture.get(int(wc.layer), ())),
    "linear_binding": lambda wc: (C.calib.linear_hessian_binding(int(wc.layer))
                                  if int(wc.layer) in C.calib.linear_capture else None),
    "device": config["encode"]["device"],
    "devices": config["encode"].get("devices", []),
    "locks": f"{OUT}/locks",
}


# the params every encoding job takes (encode, encode_layer*, native, weight_only, encode_linears): where it runs and
# the lock directory of its device slots (fq.workflow.devices), and the seed of its encodes
ENCODE_PARAMS = {
    "device": config["encode"]["device"],
    "devices": config["encode"].get("devices", []),
    "seed": config["encode"].get("seed", 0),
    "locks": f"{OUT}/locks",
}


def hessian_inputs(layer):
    """Asked for only by a job that will encode (as the staged shards are); ancient: the binding (its sha256)
    decides whether a Hessian is the right one, not the file's age."""
    return {"hessian": ancient(C.calib.hessian(layer))} if layer in C.calib.calibrated_layers else {}


def encode_spec(wc, output):
    """What the job encodes (Campaign.encode_spec, fq.workflow.specs.EncodeSpec as JSON). Derived from the outputs,
    so Snakemake neither stores nor compares it (a layer's spec is large); the rerun key is encode_key (below)."""
    paths = [output.fragment] if isinstance(output.fragment, str) else output.fragment
    return C.encode_spec(wc.node, int(wc.layer), paths).to_json()


def share_spec(wc):
    """A share job's base, owner base, digests and paths (Campaign.share_spec): also its rerun key."""
    return C.share_spec(wc.node, int(wc.layer), int(wc.block)).to_json()


def share_inputs(wc):
    """The owner base's committed fragment of the block, its attestation and metrics."""
    spec = share_spec(wc)
    return {"campaign": ancient(C.campaign_json), "key": ancient(KEY), "fragment": spec["owner_fragment"],
            "attestation": C.attestation(spec["owner_fragment"]), "metrics": spec["owner_metrics"]}


def linear_job(wc):
    """(linear node, layer) of a linear job's wildcards (layer None: the head)."""
    return wc.lnode, None if wc.unit == "head" else int(wc.unit.removeprefix("layer"))


def linear_inputs(wc):
    """The committed skeleton shards it reads (with attestations), a stage residual's parent linear fragments (with
    theirs), and its Hessian in a calibrated campaign."""
    node, layer = linear_job(wc)
    shards = C.linears.skeletons(node, layer)
    parents = [a["path"] for a in C.linears.ancestors(node, layer)]  # a stage's residual: the fragments it corrects
    inputs = {"campaign": ancient(C.campaign_json), "key": ancient(KEY), "skeleton": shards,
              "attestations": [C.attestation(s) for s in shards + parents]}
    if parents:
        inputs["parents"] = parents
    ref = C.calib.linear_hessian_ref(layer)
    if ref is not None:
        inputs["hessian"] = ancient(ref.path)
    return inputs


def linear_spec(wc):
    return C.linears.spec(*linear_job(wc)).to_json()


def linear_key(wc):
    """The rerun key: the linear node's digest, its linears, and whether it is calibrated."""
    node, layer = linear_job(wc)
    return {"node_digest": C.plan.linear(node)["digest"], "linears": list(C.linears.names(node, layer)),
            "calibrated": bool(C.calib.settings)}


def encode_key(wc):
    """The encode rerun key (a Snakemake param, compared with the one recorded for each output): the node's recipe
    digest and its experts in the whole layer -- the same for a block job and a layer job, so a campaign can
    switch encode.per_job without re-encoding what is committed."""
    calibrated = int(wc.layer) in C.calib.calibrated_layers
    weighting = C.calib.settings["weighting"] if calibrated else "none"
    return {
        "node_digest": C.recipe.node_digest(wc.node),
        "experts": [e for f in C.layer_fragments(wc.node, int(wc.layer)) for e in f.experts],
        "calibrated": calibrated,
        # only when set: an unweighted campaign's recorded keys stay as they were (no re-encode)
        **({"weighting": weighting} if weighting != "none" else {}),
    }


def encode_layer_threads():
    """The threads a profile sets for encode_layer (set-threads), for the other layer rules (known at parse time)."""
    return workflow.resource_settings.overwrite_threads.get("encode_layer")


def encode_layer_group(wc):
    """The group a profile sets for encode_layer (groups: profiles/slurm), for the other layer rules. Snakemake hands
    its group settings to the workflow only after parsing, so this is a function, called when it forms group jobs."""
    group = workflow.group_settings.overwrite_groups.get("encode_layer")
    return group.format(**dict(wc.items())) if group else None


def native_block(wc):
    return C.block(int(wc.layer), int(wc.block))


def native_inputs(wc):
    b = native_block(wc)
    K = int(wc.K)
    done = all(Path(p).is_file() for p in (C.compare.native_metrics(K, wc.codebook, b),
                                           C.compare.native_tensors(K, wc.codebook, b)))
    inputs = {"usage": ancient(C.usage_file)} if C.usage_file else {}  # its experts may be a hot stage's
    return {**inputs, "shards": staged_shards(b), **hessian_inputs(b.layer)} if not done else inputs


def native_spec(wc):
    return C.compare.native_spec(int(wc.K), wc.codebook, native_block(wc)).to_json()


def weight_only_inputs(wc):
    """A twin's ancestors' twins (the chain is weight-only all the way), and the staged shards only when it will
    run (as native_inputs: a finished twin never makes Snakemake stage a retired window again)."""
    f = fragment_of(wc)
    inputs = {"ancestors": [C.compare.weight_only_tensors(a, f.block) for a in C.ancestors(wc.node)]}
    if C.usage_file and C.reads_usage(wc.node):
        inputs["usage"] = ancient(C.usage_file)  # a hot stage's experts are the measurement's first
    if C.compare.weight_only_needs_source(wc.node, f.block):
        inputs["shards"] = staged_shards(f.block)
    return inputs


def weight_only_spec(wc):
    return C.compare.weight_only_spec(wc.node, fragment_of(wc).block).to_json()


def weight_only_files():
    return [p for f in C.compare.weight_only_jobs
            for p in (C.compare.weight_only_tensors(f.node, f.block), C.compare.weight_only_metrics(f.node, f.block))]


def skeleton_inputs(wc):
    inputs = {"campaign": ancient(C.campaign_json), "key": ancient(KEY)}
    if not Path(C.skeleton(wc.shard)).is_file():
        inputs["shard"] = C.staged(wc.shard)
    return inputs


def stage_gate(wc):
    """Window w is staged only once window w-W has retired."""
    w = C.shard_window(wc.shard)
    return [C.retired(w - W)] if w - W >= 0 else []


def pending_rules():
    """Names of the rules with jobs to run (for the launcher's checks); None if Snakemake does not say."""
    try:
        return {job.rule.name for job in workflow.dag.needrun_jobs()}
    except Exception:
        return None


def repair_marker():
    """A fresh finalize input when planned outputs are missing (fq.workflow.campaign.missing_committed)."""
    # Only the launcher decides on a repair: a cluster job (profiles/slurm) re-parses this file after other
    # jobs have changed the campaign, and would otherwise demand a marker for a different set of files.
    if workflow.remote_exec:
        return []
    missing = C.missing_committed() if Path(C.campaign_json).is_file() else []
    if not missing:
        return []
    digest = hashlib.sha256("\n".join(missing).encode()).hexdigest()[:16]
    return [f"{OUT}/repair/{digest}.missing"]


def fragment_files():
    out = []
    for f in C.fragments:
        p = C.fragment(f.node, f.block)
        out += [p, C.attestation(p)]
    return out


def skeleton_files():
    out = []
    for s in C.skeleton_shards:
        out += [C.skeleton(s), C.attestation(C.skeleton(s))]
    return out + C.linears.variant_files()


def linear_files():
    return C.linears.files()


def metrics_files():
    return [C.metrics(f.node, f.block) for f in C.fragments] + [
        C.compare.native_metrics(K, cb, b) for (K, cb), blocks in C.compare.native_jobs.items() for b in blocks
    ]


def native_tensor_files():
    return [C.compare.native_tensors(K, cb, b) for (K, cb), blocks in C.compare.native_jobs.items() for b in blocks]


def assembly_files():
    return [f"{OUT}/published/assemblies/{p.name}.assembly.intoto.jsonl" for p in C.recipe.products]


def report_files():
    names = ("products.tsv", "quality.png", "layers.png", "products.json") + (("kl.png",) if C.evals.settings else ())
    names += ("proxy.png",) if C.calib.settings else ()
    names += ("allocation.png",) if C.recipe.budgeted else ()
    return [f"{OUT}/report/{name}" for name in names]


def all_targets():
    # a budgeted base's allocation not measured yet: it is the only target (rules/allocate.smk); the plan this run
    # parsed is provisional, and the next run plans the encode jobs from the allocation
    if C.allocation_pending:
        return [C.alloc.file]
    # the repair marker is a target too: Snakemake starts re-running only from a target that is out of date
    return [
        f"{OUT}/{SUMMARY}",
        f"{OUT}/published.verified",
        *report_files(),
        *C.evals.files(),
        *repair_marker(),
    ]
