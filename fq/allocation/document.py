"""fq-allocation/1: a model's measured allocation units and the allocations solved from them.

One document serves ``fq allocate``, the campaign's ``sensitivity`` and ``allocate`` jobs and the planner
(the measurement that makes one: fq.workflow.allocation.measure):

    with_allocations(doc, bits)   -> doc with one allocation per budget   (the solver: pure, milliseconds)
    load(path) / parse(doc, where)                                    (checked: a clear error names file and field)
    allocation_at(doc, bits, where) -> {unit: K}                     (what a budgeted base is resolved with)

Canonical JSON, no timestamp: the same model, text and settings give the same bytes on the same torch build.
"""
from __future__ import annotations

from pathlib import Path

from fq.allocation import inject, solve
from fq.core import canonical
from fq.errors import FqError

FORMAT = "fq-allocation/1"
# the measurement's default settings, for fq allocate, the campaign's sensitivity job and fq price alike: calibration
# windows x tokens per window, label samples per window, direction and label seed
SENSITIVITY = {"rows": 16, "columns": 128, "samples": 4, "seed": 0}
# the streamed measurement's default cap on the injection streams' hidden states alive at once (fq.allocation.streamed)
STREAM_BYTES = 16 << 30
METHOD = ("unit u at K: a_u D(K) + b_u sqrt(D(K)), fitted through the output KL of u's LDLQ-shaped error injected "
          f"at K {', '.join(map(str, inject.INJECT_KS))} (K1 as measured); D(K) = d(K) c(K), c the encoder's measured "
          "LDLQ efficiency; an allocation: the second-order terms summed, plus the root of the first-order terms' "
          "squares summed")


def options(doc: dict) -> dict:
    """unit -> {K: (predicted KL, bytes)}, as fq.allocation.solve takes them."""
    return {u: {k_of(K): (v["predicted_kl"], v["bytes"]) for K, v in o.items()} for u, o in doc["units"].items()}


def k_of(key) -> int | float:
    """A K as the document writes it (a JSON key "3" or "1.5", or a number): int, or a half-integer float."""
    text = str(key)
    return float(text) if "." in text else int(text)


# K1 is a candidate only where a budget cannot be met without it: the Fisher prediction of a K1 unit is too
# optimistic (on the demo, re-solving the 2.5-bit allocation without K1 lowered measured KL by 21-23% at the same
# bytes, docs/benchmarks.md "fq allocation against exllamav3's converter"), while K2..8 rank right. K1.5 (mul1), the
# rate exllamav3 gives routed experts at 2 bits, is a candidate: it is read between K1's measured point and K2's
LEAST_K = 1.5


def with_allocations(doc: dict, bits, least_K: float = LEAST_K) -> dict:
    """``doc`` with one solved allocation per budget in ``bits`` (sorted, duplicates once), each unit at ``least_K``
    or more where the budget allows (else every measured K: ``least_K`` in the allocation says which). A document
    with ``parts`` (each unit's second- and first-order KL per K) is solved for the pooled prediction
    (fq.allocation.solve.solve_pooled), one without for the sum of its units' predicted KL."""
    opts, weights = options(doc), doc["weights"]
    split = doc.get("parts")
    if split:
        split = {u: {k_of(K): tuple(v) for K, v in p.items()} for u, p in split.items()}
        sizes = {u: {K: by for K, (_, by) in o.items()} for u, o in opts.items()}
    out = []
    for b in sorted(set(float(x) for x in bits)):
        budget = solve.budget_from_bits(b, weights)
        if split:
            a, least = solve.solve_pooled(split, sizes, budget, weights, least_K)
        else:
            a, least = solve.solve_from(opts, budget, weights, least_K)
        out.append({"budget_bits": b, "bits": a.bits, "bytes": a.bytes, "predicted_kl": a.predicted_kl,
                    "gap_bound": a.gap_bound, "least_K": least, "ks": a.ks})
    return {**doc, "allocations": out}


def parse(doc, where: str) -> dict:
    """Check an fq-allocation/1 document's shape (the fields the planner reads), naming the field that is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise FqError(f"{where}: format: expected {FORMAT!r}, got {got!r}")
    for key, kind in (("units", dict), ("allocations", list), ("weights", int), ("model", dict), ("codebook", str)):
        if not isinstance(doc.get(key), kind):
            raise FqError(f"{where}: {key}: expected {'an object' if kind is dict else 'a ' + kind.__name__}, "
                          f"got {type(doc.get(key)).__name__}")
    for u, opts in doc["units"].items():
        if not isinstance(opts, dict) or not opts:
            raise FqError(f"{where}: units.{u}: expected an object of K -> {{predicted_kl, bytes}}")
        for K, v in opts.items():
            if not (isinstance(v, dict) and isinstance(v.get("bytes"), int)
                    and isinstance(v.get("predicted_kl"), (int, float))):
                raise FqError(f"{where}: units.{u}.{K}: expected {{predicted_kl: number, bytes: integer}}")
    for i, a in enumerate(doc["allocations"]):
        if not (isinstance(a, dict) and isinstance(a.get("budget_bits"), (int, float)) and isinstance(a.get("ks"), dict)):
            raise FqError(f"{where}: allocations[{i}]: expected {{budget_bits: number, ks: {{unit: K}}, ...}}")
        missing = sorted(set(doc["units"]) - set(a["ks"]))
        if missing or set(a["ks"]) - set(doc["units"]):
            raise FqError(f"{where}: allocations[{i}].ks: expected a K for every unit of units "
                          f"({'missing ' + ', '.join(missing) if missing else 'unknown units'})")
        for u, K in a["ks"].items():
            if str(K) not in doc["units"][u]:
                raise FqError(f"{where}: allocations[{i}].ks.{u}: K {K!r} is not one of that unit's measured options "
                              f"({', '.join(doc['units'][u])})")
    return doc


def load(path) -> dict:
    path = Path(path)
    try:
        doc = canonical.load(path)
    except FileNotFoundError:
        raise FqError(f"{path}: allocation file not found") from None
    return parse(doc, str(path))


def allocation_at(doc: dict, bits: float, where: str) -> dict:
    """{unit: K} of the document's allocation at budget ``bits``."""
    for a in doc["allocations"]:
        if abs(a["budget_bits"] - bits) < 1e-9:
            return {u: k_of(K) for u, K in a["ks"].items()}
    have = ", ".join(f"{a['budget_bits']:g}" for a in doc["allocations"]) or "none"
    raise FqError(f"{where}: no allocation at {bits:g} bits (it holds: {have}); solve it from the same measurement "
                  f"with `fq allocate ... --bits {bits:g}`")


def sha256(doc: dict) -> str:
    return canonical.sha256_hex(canonical.dumps(doc))
