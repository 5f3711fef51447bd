"""The rule -> script contract (fq.workflow.specs): the demo campaign's job specs, built by the campaign as the rules
build them, survive the JSON Snakemake carries them in, keep the JSON the scripts read before the records existed (so
no committed job reruns for them), and a malformed spec is refused naming the field."""
import pytest

from fq.errors import FqError
from fq.workflow.campaign import load_campaign
from fq.workflow.specs import (AncestorRef, EncodeSpec, HessianRef, LinearSpec, NativeSpec, ShareSpec,
                               WeightOnlySpec)


@pytest.fixture(scope="module")
def c():
    return load_campaign({"campaign": "t", "out": "o", "source": {"kind": "demo"}, "recipe": "recipes/demo.json",
                          "block_size": 4, "windows": "1,2", "windows_on_disk": 1, "encode": {"device": "cpu"},
                          "compare_native": True, "calibration": {"compare_weight_only": True},
                          "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}})


def _round_trip(spec):
    doc = spec.to_json()
    again = type(spec).from_json(doc)
    assert again == spec and again.to_json() == doc
    return doc


def test_every_spec_survives_its_json(c):
    stage = next(f for f in c.encoded_fragments if len(c.ancestors(f.node)) == 1)
    layer = stage.block.layer
    enc = c.encode_spec(stage.node, layer, [c.fragment(stage.node, stage.block)])
    doc = _round_trip(enc)
    # the JSON the encode script read before: the same keys in the same order, ancestors with their digests
    assert list(doc) == ["node", "role", "K", "codebook", "node_digest", "layer", "blocks", "layout", "hessian"]
    assert doc["role"] == "stage" and len(doc["blocks"]) == 1 and doc["blocks"][0]["experts"] == list(stage.experts)
    (anc,) = doc["blocks"][0]["ancestors"]
    assert list(anc) == ["node", "codebook", "digest", "path"] and anc["path"] == c.fragment(anc["node"], stage.block)
    assert doc["hessian"] == {"path": c.calib.hessian(layer), "binding": c.calib.hessian_binding(layer)}
    # a layer job's spec holds every block of the node's layer
    whole = c.encode_spec(stage.node, layer, [c.fragment(stage.node, f.block)
                                              for f in c.layer_fragments(stage.node, layer)])
    assert [b.block for b in whole.blocks] == [c.block_index(f.block) for f in c.layer_fragments(stage.node, layer)]

    twin = c.compare.weight_only_spec(stage.node, stage.block)
    doc = _round_trip(twin)
    assert all("digest" not in a for a in doc["ancestors"]) and twin.ancestors[0].digest is None
    (K, cb), blocks = next(iter(c.compare.native_jobs.items()))
    _round_trip(c.compare.native_spec(K, cb, next(iter(blocks))))
    node, unit = c.linears.jobs[0]
    lin = c.linears.spec(node, unit)
    assert list(_round_trip(lin))[:2] == ["node", "class"] and isinstance(lin.hessian, HessianRef)
    shared = c.shared_fragments[0]
    _round_trip(c.share_spec(shared.node, shared.block.layer, c.block_index(shared.block)))


def test_a_malformed_spec_is_refused_naming_the_field(c):
    f = c.encoded_fragments[0]
    doc = c.encode_spec(f.node, f.block.layer, [c.fragment(f.node, f.block)]).to_json()
    with pytest.raises(FqError, match="EncodeSpec field 'node_digest' missing"):
        EncodeSpec.from_json({k: v for k, v in doc.items() if k != "node_digest"})
    with pytest.raises(FqError, match="EncodeSpec has no field 'extra'"):
        EncodeSpec.from_json({**doc, "extra": 1})
    with pytest.raises(FqError, match=r"job spec\.layer: expected int, got '1'"):
        EncodeSpec.from_json({**doc, "layer": "1"})
    with pytest.raises(FqError, match=r"job spec\.blocks\[0\]\.experts\[0\]: expected int"):
        EncodeSpec.from_json({**doc, "blocks": [{**doc["blocks"][0], "experts": [True]}]})
    with pytest.raises(FqError, match=r"job spec\.hessian: HessianRef field 'binding' missing"):
        EncodeSpec.from_json({**doc, "hessian": {"path": "h"}})
    with pytest.raises(FqError, match="expected a NativeSpec"):
        NativeSpec.from_json([1])
    assert AncestorRef.from_json({"node": "a", "codebook": "mul1", "path": "p"}).digest is None
    for cls in (LinearSpec, ShareSpec, WeightOnlySpec):
        with pytest.raises(FqError, match=f"{cls.__name__} field"):
            cls.from_json({})


def test_twins_of_named_nodes_cover_their_chains_only():
    """calibration.compare_weight_only as a list: twins for each named node's chain (a stage's twin is taken against
    its ancestors' twins; a base publishing another base's experts has that base's), no others; an unknown name is
    refused naming the setting and the recipe's nodes."""
    def twins(value):
        c = load_campaign({"campaign": "t", "out": "o", "source": {"kind": "demo"}, "recipe": "recipes/demo.json",
                           "block_size": 4, "windows": "1,2", "windows_on_disk": 1, "encode": {"device": "cpu"},
                           "calibration": {"compare_weight_only": value},
                           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}})
        return c, {f.node for f in c.compare.weight_only_jobs}

    c, every = twins(True)
    assert every == {f.node for f in c.encoded_fragments} and c.compare.weight_only_nodes is None
    assert twins(False)[1] == set()
    c, chain = twins(["k2.r1"])
    assert chain == {"k2", "k2.r1"} and len(c.compare.weight_only_jobs) == sum(
        f.node in chain for f in c.encoded_fragments)
    assert twins(["k3.w4"])[1] == {"k3"}  # k3.w4 publishes k3's experts: k3's twins are its own
    with pytest.raises(FqError, match=r"calibration.compare_weight_only: no node 'k9' in recipe demo \(its nodes: k2,"):
        twins(["k9"])
