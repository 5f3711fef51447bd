"""Bad input to the codec raises FqError (a ValueError) naming the tensor and what was expected."""
import pytest
import torch

from fq.codec import quantize, quantize_residual, reconstruct, reconstruct_chain, validate_tensors
from fq.errors import FqError


@pytest.fixture(scope="module")
def good():
    return quantize(torch.randn(128, 256) * 0.02, 2, "mul1")


@pytest.mark.parametrize(
    "W,K,cb,match",
    [
        (torch.randn(100, 128), 2, "mul1", r"W: shape \(out=100, in=128\).*multiples of 128"),
        (torch.randn(128, 200), 2, "mul1", r"in=200"),
        (torch.randn(128), 2, "mul1", r"2-D"),
        (torch.randn(128, 128), 0, "mul1", r"K: expected an integer in 1\.\.8 or a half-integer rate 1\.5, 2\.5 or 3\.5, got 0"),
        (torch.randn(128, 128), 9, "mul1", r"K: .* got 9"),
        (torch.randn(128, 128), 2.0, "mul1", r"K: "),
        (torch.randn(128, 128), 2, "qtip", r"codebook: unknown codebook 'qtip'"),
        (torch.randint(0, 3, (128, 128)), 2, "mul1", r"floating-point"),
    ],
)
def test_bad_quantize_arguments(W, K, cb, match):
    with pytest.raises(FqError, match=match):
        quantize(W, K, cb)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight(bad):
    W = torch.zeros(128, 128)
    W[3, 7] = bad
    with pytest.raises(FqError, match=r"W: contains NaN or Inf \(first at \[3, 7\]\)"):
        quantize(W, 2)


def test_fqerror_is_a_valueerror():
    assert issubclass(FqError, ValueError)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(suh=None), r"w\.suh: missing"),
        (dict(trellis=None), r"w\.trellis: missing"),
        (dict(suh="float32"), r"w\.suh: expected float16 \(256,\), got float32 \(256,\)"),
        (dict(svh="short"), r"w\.svh: expected float16 \(128,\), got float16 \(64,\)"),
        (dict(trellis="int32"), r"w\.trellis: expected int16"),
        (dict(trellis="lastdim"), r"w\.trellis: last dimension 44 is not 16\*K"),
        (dict(mul1="value"), r"w\.mul1: marker value 0x00000001, expected 0x83dcd12d"),
        (dict(mcg="both"), r"both mcg and mul1"),
        (dict(extra="x"), r"unexpected keys \['extra'\]"),
    ],
)
def test_bad_tensor_sets(good, change, match):
    (key, how), = change.items()
    t = dict(good)
    if how is None:
        t.pop(key)
    elif how == "float32":
        t[key] = t[key].float()
    elif how == "short":
        t[key] = t[key][:64]
    elif how == "int32":
        t[key] = t[key].int()
    elif how == "lastdim":
        t[key] = torch.zeros(16, 8, 44, dtype=torch.int16)
    elif how == "value":
        t[key] = torch.tensor(1, dtype=torch.int32)
    elif how == "both":
        t[key] = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32)
    else:
        t[key] = torch.zeros(1)
    with pytest.raises(FqError, match=match):
        reconstruct(t, "w")


def test_trellis_k_mismatch_is_named(good):
    with pytest.raises(FqError, match=r"w\.trellis: last dimension 32 means K=2, expected K=3 \(16\*K=48\)"):
        validate_tensors(good, "w", K=3)
    with pytest.raises(FqError, match=r"codebook is mul1 by its marker, expected mcg"):
        validate_tensors(good, "w", codebook="mcg")


def test_trellis_not_multiple_of_128(good):
    t = dict(good, trellis=torch.zeros(4, 16, 32, dtype=torch.int16), suh=torch.zeros(64, dtype=torch.float16))
    with pytest.raises(FqError, match=r"in=64, out=256; both must be positive multiples of 128"):
        reconstruct(t)


def test_residual_shape_mismatch_and_empty_chain(good):
    with pytest.raises(FqError, match=r"parents: chain reconstructs to \(128, 256\), W is \(256, 256\)"):
        quantize_residual(torch.randn(256, 256), [good], 1)
    with pytest.raises(FqError, match=r"parents: expected a non-empty list"):
        quantize_residual(torch.randn(128, 256), [], 1)
    with pytest.raises(FqError, match=r"empty chain"):
        reconstruct_chain([])
