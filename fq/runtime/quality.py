"""Quality at the model's output: a model against a reference (the source checkpoint) on the same token windows.

Per predicted position (every position of a window but its last, which has no next token), with P the
reference's next-token distribution and Q the model's (log-softmax of float32 logits, in float64):

- ``kl``: KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)), in nats, averaged over positions;
- ``ppl``: exp of the mean negative log-likelihood of the actual next token under Q (the reference's own is
  ``Reference.ppl``);
- ``top1``: the share of positions where Q's most likely token is P's (``argmax``, first index on ties);
- ``kl_windows``: the mean KL of each window, and ``kl_se`` the standard error of ``kl`` from them (windows are
  the independent samples; positions within one are not): two models' KL differ meaningfully only by more than a
  few of these (for a paired comparison on the same windows, use the per-window differences).

Deterministic on the CPU: forwards run with one intra-op thread (``torch.set_num_threads(1)``, restored after)
and a fixed batch size, so every matrix product reduces in the same order on every run and on any number of
cores; per-position values are summed exactly (``math.fsum``), so the means do not depend on the order either.
(A different CPU instruction set or torch build may still change the last digits: the numbers are
reproducible per machine and build.)

    token_windows(ids, seq_len, tokens) -> LongTensor (n, seq_len)
    Reference(model, windows)                        # the reference's log-probabilities, computed once
    compare(model, reference) -> Quality
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fq.core.threads import torch_threads
from fq.errors import FqError

THREADS = 1
BATCH = 8


def token_windows(ids, seq_len: int, tokens: int):
    """The first ``tokens`` ids (rounded down to whole windows) as ``(n, seq_len)`` windows."""
    import torch

    if seq_len < 2:
        raise FqError(f"eval: seq_len {seq_len}: a window needs at least 2 tokens")
    n = min(len(ids), tokens) // seq_len
    if n < 1:
        raise FqError(f"eval: {len(ids)} tokens of text, fewer than one window of {seq_len} (tokens={tokens})")
    return torch.tensor(list(ids[: n * seq_len]), dtype=torch.long).reshape(n, seq_len)


def _log_probs(model, windows):
    """Per batch of windows: float64 log-softmax of the next-token logits at every position but the last."""
    import torch

    out = []
    with torch_threads(THREADS), torch.no_grad():
        for lo in range(0, windows.shape[0], BATCH):
            logits = model(input_ids=windows[lo: lo + BATCH]).logits
            out.append(torch.log_softmax(logits[:, :-1].double(), dim=-1))
    return out


@dataclass(frozen=True)
class Quality:
    positions: int
    kl: float  # nats, mean over positions
    ppl: float
    top1: float
    nll: float
    kl_se: float | None = None
    kl_windows: tuple[float, ...] = ()

    def to_json(self) -> dict:
        return {**asdict(self), "kl_windows": list(self.kl_windows)}


class Reference:
    def __init__(self, model, windows):
        self.windows = windows
        self.labels = windows[:, 1:]
        self.log_probs = _log_probs(model, windows)
        self.argmax = [lp.argmax(dim=-1) for lp in self.log_probs]
        nll = [-lp.gather(-1, self._labels(i)[..., None])[..., 0] for i, lp in enumerate(self.log_probs)]
        self.positions = self.labels.numel()
        self.nll = mean([v for t in nll for v in t.flatten().tolist()])
        self.ppl = math.exp(self.nll)

    def _labels(self, batch: int):
        return self.labels[batch * BATCH: (batch + 1) * BATCH]


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def compare(model, ref: Reference) -> Quality:
    """``model`` against the reference on the reference's windows."""
    import torch

    kl, nll, agree, per_window = [], [], 0, []
    for i, lq in enumerate(_log_probs(model, ref.windows)):
        lp = ref.log_probs[i]
        rows = (lp.exp() * (lp - lq)).sum(dim=-1).tolist()
        per_window += [mean(r) for r in rows]
        kl += [v for r in rows for v in r]
        nll += (-lq.gather(-1, ref._labels(i)[..., None])[..., 0]).flatten().tolist()
        agree += int(torch.eq(lq.argmax(dim=-1), ref.argmax[i]).sum())
    mean_nll = mean(nll)
    return Quality(positions=len(kl), kl=mean(kl), ppl=math.exp(mean_nll), top1=agree / len(kl), nll=mean_nll,
                   kl_se=standard_error(per_window), kl_windows=tuple(per_window))


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean of ``values`` (sample standard deviation / sqrt(n)); None below two values."""
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1) / n)
