"""A base's routed-expert linears against its model config: every one is stored at its matrix's padded shape.

A routed expert's matrices are (out, in) = (intermediate, hidden) for gate and up and (hidden, intermediate) for
down, as the base's ``source_config.json`` (the source's config.json, verbatim) makes them; EXL3 stores each
zero-padded to multiples of 128 (``fq.codec.shape``: gpt-oss's 2880 at 2944, a 128-aligned dim as it is). The
stored dims are what the tensors imply (``fq.model.experts.derive_linear``: trellis (in/16, out/16, 16K), suh (in,),
svh (out,)); a base fragment whose linear is stored at any other shape (transposed, cut, padded too far) is refused,
one line per fragment, by everything that verifies a base (``fq verify``, ``fq combine --base``, the runtimes:
``fq.provenance.manifest``). Stages keep their base's geometry (``fq.provenance.assembly.check_geometry``).

A config that does not state the family's hidden and intermediate sizes (a hand-made test base; no model runtime
loads one) is not checked here; the runtimes refuse to build from it.

    stored_shape_problems(base_dir, files, shards, bad) -> [problem]
"""
from __future__ import annotations

from pathlib import Path

from fq.core.canonical import loads
from fq.core.safepath import read_regular
from fq.errors import FqError

SOURCE_CONFIG = "source_config.json"


def stored_shape_problems(base_dir, files, shards: dict, bad=()) -> list[str]:
    """``files``: the manifest's listing; ``shards``: name -> Attested of its verified shards; ``bad``: listed files
    already reported (their own problem is the one line)."""
    from fq.codec.shape import padded_shape
    from fq.model.source import PROJECTIONS, config_expert_shapes

    experts = {name: att for name, att in shards.items() if att.info.kind == "expert"}
    if not experts or SOURCE_CONFIG not in files or SOURCE_CONFIG in bad:
        return []
    where = f"{Path(base_dir)}/{SOURCE_CONFIG}"
    try:
        config = loads(read_regular(base_dir, SOURCE_CONFIG, where), where)
        own = config_expert_shapes(config, where) if isinstance(config, dict) else None
    except FqError:
        return []  # not a config the family's sizes can be read from: see the module docstring
    if own is None:
        return []
    problems = []
    for name, att in sorted(experts.items()):
        layout = att.info.meta["layout"]
        role = dict(zip(layout.projections, PROJECTIONS))
        for (expert, proj), lin in sorted(att.info.linears.items()):
            shape = own[role[proj]]
            want, got = padded_shape(shape), (lin.out_features, lin.in_features)
            if got != want:
                how = f", stored zero-padded at {want}" if want != shape else ""
                problems.append(f"{Path(base_dir)}/{name}: expert {expert} {proj} is stored at (out, in) = {got}; "
                                f"{SOURCE_CONFIG} makes the matrix {shape}{how}")
                break
    return problems
