"""Why a K1 stage on a K2 base stays above native K3 in the calibration metric (issue 41, item 4), on the trained demo
model's 48 routed-expert linears (2 MoE layers x 8 experts x gate/up/down), their all-experts calibration Hessians
(16 x 128 tokens of the calibration split, as the demo campaign captures them), fq's LDLQ encoder (mul1).

    .venv/bin/python benchmarks/k1_stage_floor.py OUT.json [--work /tmp/k1floor] [--sweeps 2] [--threads 2]

Measured per linear, as tr(E H E^T) / tr(W H W^T) with H the calibration Hessian (the proxy error), then averaged:

- ``K2``, ``K3``: the bases (fq's encoder as shipped);
- ``floor``: D1 x proxy(K2) / proxy(K3), D1 = 0.272971 the K1 trellis's MSE on unit Gaussian tiles (docs/benchmarks.md,
  "Codec quality"): what a K1 stage would reach if it coded the base's LDLQ innovations (the rounding residuals r_j,
  whose D-weighted energy is the base's proxy error) as well as it codes a Gaussian, i.e. with no error feedback of its
  own. A second LDLQ pass does feed its own errors back: its targets are r_j plus the K1 errors of the columns coded
  before, and at K1 (27% of the target's variance) that feedback is large;
- ``stage``: the K1 stage as the campaign encodes it (its own seed: a stage's matrix seed names its node);
  ``stage-same-seed``: with its base's seed (the same signs and Hadamard basis);
- ``stage-cd``: the stage, then ``--sweeps`` block coordinate-descent sweeps over the 16-row blocks (each block recoded
  by the Viterbi search against its conditional target T_b + H_bb^-1 H_b,rest E_rest, a tile kept only where the
  proxy drops); ``K2-cd``, ``K3-cd`` the same on the bases. Plain float64 (numpy/torch BLAS), not fq's exact path: a
  measurement of what the sweeps buy, not an encoder.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

import hessian_variants as hv  # noqa: E402
from fq.allocation.measure import weights  # noqa: E402
from fq.codec import ldlq as ldlq_mod  # noqa: E402
from fq.codec import ldlq_parts  # noqa: E402
from fq.codec.codebook import values_torch  # noqa: E402
from fq.codec.ldlq import encode_ldlq_batch, proxy_error  # noqa: E402
from fq.codec.scale_search import _viterbi  # noqa: E402
from fq.model import demo_model  # noqa: E402
from fq.runtime.evaluate import tokenize  # noqa: E402
from fq.runtime.quality import token_windows  # noqa: E402

D1_GAUSSIAN = 0.272971  # mul1 K1 on unit Gaussian tiles (docs/benchmarks.md, "Codec quality")
BLOCK = 16


class Sweeps:
    """Wraps fq.codec.ldlq's factorization (to keep each matrix's rotated damped Hessian) and its LDLQ walk (to add
    coordinate-descent sweeps after it) while ``n`` > 0."""

    def __init__(self):
        self.n = 0
        self.rotated: list = []
        self.gain: list = []  # (proxy in the walk's basis before, after) per matrix
        self._factor, self._ldlq = ldlq_mod._factor, ldlq_mod.ldlq

    def __enter__(self):
        ldlq_mod._factor, ldlq_mod.ldlq = self.factor, self.walk
        return self

    def __exit__(self, *exc):
        ldlq_mod._factor, ldlq_mod.ldlq = self._factor, self._ldlq

    def factor(self, Hs, sigmas, sus, names, device):
        out = self._factor(Hs, sigmas, sus, names, device)
        self.rotated = [ldlq_parts.rotated_hessian(out[3][i], sus[i]) for i in range(len(sus))]
        return out

    def walk(self, targets, L, F, K, codebook, device):
        states = self._ldlq(targets, L, F, K, codebook, device)
        if self.n == 0:
            return states
        values = values_torch(codebook, device)
        return [self.sweep(T, st.clone(), R, K, codebook, device, values)
                for T, st, R in zip(targets, states, self.rotated)]

    def sweep(self, T, st, R, K, codebook, device, values):
        def rows(s):  # (k/16, n/16, 256) states -> (k, n) decoded
            return ldlq_parts._tiles_to_rows(values[s.long()]).to(torch.float64).reshape(-1, T.shape[1])

        E = T - rows(st)
        RE = R @ E
        before = float((E * RE).sum())
        for _ in range(self.n):
            for bj in range(T.shape[0], 0, -BLOCK):
                bi = bj - BLOCK
                Rbb, Eb = R[bi:bj, bi:bj], E[bi:bj]
                cross = RE[bi:bj] - Rbb @ Eb  # H_b,rest E_rest
                x = T[bi:bj] + torch.linalg.solve(Rbb, cross)
                new = _viterbi(ldlq_parts._rows_to_tiles(x[None].to(torch.float32)), K, codebook, device, check=False)
                En = T[bi:bj] - rows(new[None])

                def cost(e):  # per output column: e^T H_bb e + 2 e^T (H_b,rest E_rest)
                    return (e * (Rbb @ e)).sum(0) + 2 * (e * cross).sum(0)
                keep = (cost(En) - cost(Eb)).reshape(-1, BLOCK).sum(1) < 0  # per tile column
                if keep.any():
                    m = keep.repeat_interleave(BLOCK)[None, :]
                    Enew = torch.where(m, En, Eb)
                    RE += R[:, bi:bj] @ (Enew - Eb)
                    E[bi:bj] = Enew
                    st[bi // BLOCK][keep] = new[keep]
        self.gain.append((before, float((E * RE).sum())))
        return st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--work", default="/tmp/k1floor")
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    mdir, model = hv.demo_source(a.work)
    cal = token_windows(tokenize(mdir, demo_model.text("calibration"))[0], 128, 16 * 128)
    H, _ = hv.hessians_for(hv.capture(model, cal, weightings=("all",)), "all")
    W = weights(model)
    names = sorted(H)
    sweeps = Sweeps()

    def encode(K, seed_offset=0, parents=None, n_sweeps=0):
        sweeps.n = n_sweeps
        with sweeps:
            return {n: encode_ldlq_batch([W[n].double()], H[n], K, "mul1", [i + seed_offset], names=[n],
                                         parents=None if parents is None else [[parents[n].tensors]])[0]
                    for i, n in enumerate(names)}

    def proxy(*parts) -> float:
        errs = [proxy_error(W[n].double(), sum(p[n].W_hat.double() for p in parts), H[n]) for n in names]
        return sum(errs) / len(errs)

    rows = {}
    k2, k3 = encode(2), encode(3)
    rows["K2"], rows["K3"] = proxy(k2), proxy(k3)
    rows["floor"] = D1_GAUSSIAN * rows["K2"] / rows["K3"]
    hv.log(f"K2 {rows['K2']:.6f} K3 {rows['K3']:.6f} floor {rows['floor']:.3f}")
    rows["stage"] = proxy(k2, encode(1, 10_000, k2)) / rows["K3"]
    rows["stage-same-seed"] = proxy(k2, encode(1, 0, k2)) / rows["K3"]
    hv.log(f"stage {rows['stage']:.3f} same seed {rows['stage-same-seed']:.3f}")
    sweeps.gain.clear()
    k2c, k3c = encode(2, n_sweeps=a.sweeps), encode(3, n_sweeps=a.sweeps)
    base_gain = [after / before for before, after in sweeps.gain]
    rows["K2-cd"], rows["K3-cd"] = proxy(k2c) / rows["K2"], proxy(k3c) / rows["K3"]
    sweeps.gain.clear()
    rows["stage-cd"] = proxy(k2, encode(1, 10_000, k2, a.sweeps)) / rows["K3"]
    stage_gain = [after / before for before, after in sweeps.gain]
    hv.log(f"stage-cd {rows['stage-cd']:.3f}; bases with sweeps {rows['K2-cd']:.3f} {rows['K3-cd']:.3f} of their own")
    doc = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "linears": len(names), "sweeps": a.sweeps,
           "proxy": {"K2": rows["K2"], "K3": rows["K3"]},
           "over_native_K3": {k: rows[k] for k in ("floor", "stage", "stage-same-seed", "stage-cd")},
           "bases_with_sweeps_over_without": {"K2": rows["K2-cd"], "K3": rows["K3-cd"]},
           "walk_basis_gain": {"bases": [min(base_gain), max(base_gain)], "stage": [min(stage_gain), max(stage_gain)]},
           "seconds": round(time.time() - t0, 1),
           "machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                       "torch": torch.__version__}}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
