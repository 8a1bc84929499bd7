"""Property tests of every quantization scheme: each round-trips within its stated error bound.

Tensors are drawn as ``[batch, heads, tokens, channels]`` with zeros, constants, outliers, tiny and
huge magnitudes, float16/bfloat16 inputs, and group sizes that do not divide the grouped axis. The
low-bit schemes come from the kvcdn-quant-lowbit plugin; they are exercised here too when installed
(their own package has the same properties in its tests).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core import KEY, VALUE, role_of
from kvcdn_core.builtin.quantizers import Fp8Quantizer, Int8Quantizer, Int8TensorQuantizer
from kvcdn_core.errors import KvcdnError
from kvcdn_core.quant import codec

CORE = [Int8TensorQuantizer, Int8Quantizer, Fp8Quantizer]
PROFILE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lowbit():
    try:
        from kvcdn_quant_lowbit import Int2Quantizer, Int4Quantizer
    except ImportError:  # the core schemes are still tested
        return []
    return [Int4Quantizer, Int2Quantizer]


SCHEMES = CORE + _lowbit()


@st.composite
def cache_tensors(draw):
    """A float tensor shaped like one cache layer's keys or values, with awkward content."""
    shape = [1, draw(st.integers(1, 3)), draw(st.integers(1, 70)), draw(st.integers(1, 40))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "zeros", "constant", "outliers", "offset", "sparse"]))
    magnitude = draw(st.sampled_from([1e-7, 1e-3, 1.0, 30.0, 1e5]))
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "constant":
        x = torch.full(shape, draw(st.floats(-1.0, 1.0, allow_nan=False)) * magnitude)
    else:
        x = torch.randn(shape, generator=gen) * magnitude
        if kind == "outliers":  # a few huge entries and one outlier channel, as in real keys
            mask = torch.rand(shape, generator=gen) < 0.02
            x = torch.where(mask, x * 1000, x)
            x[..., draw(st.integers(0, shape[-1] - 1))] *= 50
        elif kind == "offset":  # values far from zero with a small spread
            x = x * 1e-3 + magnitude
        elif kind == "sparse":
            x = torch.where(torch.rand(shape, generator=gen) < 0.9, torch.zeros_like(x), x)
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    if dtype != torch.float32:
        x = x.clamp(-6e4, 6e4).to(dtype)
    return x


def _make(cls, draw_params):
    params = {}
    if "group_size" in cls.default_params:
        params["group_size"] = draw_params.draw(st.integers(1, 80))
    if "residual" in cls.default_params:
        params["residual"] = draw_params.draw(st.integers(0, 80))
    return cls(**params)


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
@PROFILE
@given(x=cache_tensors(), role=st.sampled_from([KEY, VALUE]), data=st.data())
def test_round_trip_within_bound(cls, x, role, data):
    q = _make(cls, data)
    parts, record = q.quantize(role, x)
    y = q.dequantize(parts, record)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    # The bound is on what the scheme was given; a float16/bfloat16 output adds its own rounding.
    y32 = q.dequantize(parts, record, torch.float32)
    err = (x.float() - y32).abs()
    bound = q.error_bound(role, x)
    worst = (err - bound).max()
    assert worst <= 0, f"{cls.scheme}: error exceeds bound by {float(worst):.3g} ({record})"
    if not x.any():
        assert not y.any(), "zeros must stay exactly zero"
    keep = record["residual_tokens"]
    if keep:
        assert torch.equal(y[..., -keep:, :], x[..., -keep:, :]), "the residual window is kept bitwise"


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_rows_of_subnormals_stay_within_bound(cls):
    """Rows whose peak divided by the top code underflows or rounds down keep their bound.

    Hypothesis found a one-element key of 2.5e-44 that fp8 turned into 0: ``peak / 448`` underflowed
    to a zero scale. Every multiple of float32's smallest subnormal up to past 448 of them is tried.
    """
    q = cls(**({"residual": 0} if "residual" in cls.default_params else {}))
    step = 2.0**-149
    for k in [*range(1, 1000), 2**23 - 1, 2**23 + 5]:
        for other in (0, 1, k // 3):
            x = torch.tensor([[[[k * step, other * step], [-k * step, -other * step]]]])
            for role in (KEY, VALUE):
                parts, record = q.quantize(role, x)
                err = (x - q.dequantize(parts, record, torch.float32)).abs()
                worst = float((err - q.error_bound(role, x)).max())
                assert worst <= 0, f"{cls.scheme} {role}: {k} steps, {other} steps: over by {worst / step} steps"


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_rows_at_float32s_largest_values_decode_finite_within_bound(cls):
    """A row whose peak is near float32's largest value decodes finite: the scale rounded up for it
    would make ``top code * scale`` overflow to inf, so such a scale is kept at the largest that
    fits (its top code then misses the peak by under a float32 step of the scale)."""
    q = cls(**({"residual": 0} if "residual" in cls.default_params else {}))
    big = torch.finfo(torch.float32).max
    for peak in (big, torch.nextafter(torch.tensor(big), torch.tensor(0.0)).item(), big * 0.999999, big / 2):
        for other in (0.0, 1.0, peak / 3):
            row = torch.tensor([[[[peak, other], [peak / 2, -other]]]])
            for x, role in itertools.product((row, -row), (KEY, VALUE)):
                parts, record = q.quantize(role, x)
                y = q.dequantize(parts, record, torch.float32)
                assert torch.isfinite(y).all(), f"{cls.scheme} {role}: peak {peak} decodes to {y.flatten().tolist()}"
                assert ((x - y).abs() <= q.error_bound(role, x)).all(), f"{cls.scheme} {role}: peak {peak}"


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_inf_and_nan_are_refused_in_one_line(cls):
    """No scale keeps a bound on inf or NaN: every scheme refuses them instead of writing garbage."""
    q = cls(**({"residual": 0} if "residual" in cls.default_params else {}))
    for bad in (float("inf"), -float("inf"), float("nan")):
        x = torch.ones(1, 2, 8, 4)
        x[0, 1, 3, 2] = bad
        for role in (KEY, VALUE):
            with pytest.raises(KvcdnError, match="holds inf or NaN") as caught:
                q.quantize(role, x)
            assert "\n" not in str(caught.value)


@pytest.mark.parametrize("cls", [c for c in SCHEMES if "group_size" in c.default_params], ids=lambda c: c.scheme)
def test_a_group_spanning_more_than_float32_is_refused(cls):
    """Asymmetric codes decode as ``code * scale + zero``: a group from near -3.4e38 to near +3.4e38
    has no float32 scale for that, so it is refused rather than decoded to NaN."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[[[big, 1.0], [-big, -1.0]]]])
    for role in (KEY, VALUE):
        q = cls(residual=0, group_size=2)
        if role == VALUE:
            x = x.transpose(-1, -2).contiguous()  # values are grouped along channels
        with pytest.raises(KvcdnError, match="spans more than float32"):
            q.quantize(role, x)


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_zeros_and_constants_are_exact_or_near(cls):
    q = cls(**({"residual": 0} if "residual" in cls.default_params else {}))
    for value in (0.0, 1.0, -3.5, 1000.0):
        x = torch.full((1, 2, 33, 8), value)
        for role in (KEY, VALUE):
            y = q.dequantize(*q.quantize(role, x))
            assert torch.allclose(y, x, rtol=1e-3, atol=0), (cls.scheme, value, role)


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_bound_is_tight_enough_to_mean_something(cls):
    """On ordinary data the observed error is a sizeable part of the bound (the bound is not vacuous)."""
    x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(0))
    q = cls(**({"residual": 0} if "residual" in cls.default_params else {}))
    for role in (KEY, VALUE):
        err = (x - q.dequantize(*q.quantize(role, x))).abs()
        bound = q.error_bound(role, x)
        assert (err <= bound).all()
        assert float((err / bound).max()) > 0.5, cls.scheme
        assert float(bound.max()) < float(x.abs().max()) * 0.4, cls.scheme


def test_per_channel_int8_beats_one_scale_on_outlier_channels():
    x = torch.randn(1, 1, 128, 32, generator=torch.Generator().manual_seed(1))
    x[..., 5] *= 200  # a rotary-style outlier channel
    per_tensor = Int8TensorQuantizer()
    per_channel = Int8Quantizer()
    e_t = (x - per_tensor.dequantize(*per_tensor.quantize(KEY, x))).abs()
    e_c = (x - per_channel.dequantize(*per_channel.quantize(KEY, x))).abs()
    normal = [c for c in range(32) if c != 5]
    assert float(e_c[..., normal].mean()) * 50 < float(e_t[..., normal].mean())


def test_storage_dtypes_and_shapes():
    x = torch.randn(1, 2, 10, 16)
    parts, record = Int8Quantizer().quantize(KEY, x)
    assert parts[""].dtype == torch.int8 and parts["scale"].shape == (1, 2, 1, 16)
    parts, _ = Int8Quantizer().quantize(VALUE, x)
    assert parts["scale"].shape == (1, 2, 10, 1) and parts["scale"].dtype == torch.float16
    parts, record = Fp8Quantizer().quantize(KEY, x)
    assert parts[""].dtype == torch.float8_e4m3fn and record["granularity"] == "per_token"
    parts, _ = Int8TensorQuantizer().quantize(KEY, x)
    assert parts["scale"].numel() == 1


def test_huge_values_fall_back_to_float32_scales():
    x = torch.randn(1, 1, 8, 8) * 1e7
    parts, _ = Int8Quantizer().quantize(VALUE, x)
    assert parts["scale"].dtype == torch.float32
    y = Int8Quantizer().dequantize(*Int8Quantizer().quantize(VALUE, x))
    assert ((x - y).abs() <= Int8Quantizer().error_bound(VALUE, x)).all()


def test_bad_parameters_are_refused():
    with pytest.raises(KvcdnError, match="takes no parameter group_size"):
        Int8Quantizer(group_size=64)
    with pytest.raises(KvcdnError, match="residual must be a non-negative integer"):
        Int8Quantizer.__mro__[0]  # noqa: B018 - the class exists
        type("R", (Int8Quantizer,), {"default_params": {"residual": 0}})(residual=-1)


@pytest.mark.parametrize(
    "requested,target,implied",
    [
        ("F32", "F32", None),
        ("f16", "F16", None),
        ("bfloat16", "BF16", None),
        ("float32", "F32", None),
        ("I8", None, "int8"),
        ("int8", None, "int8"),
        ("FP8", None, "fp8"),
        ("f8_e4m3", None, "fp8"),
    ],
)
def test_target_dtype_accepted(requested, target, implied):
    assert codec.normalize_target_dtype(requested) == (target, implied)


@pytest.mark.parametrize(
    "requested,why",
    [
        ("U8", "signed"),
        ("I4", "storage format"),
        ("U4", "storage format"),
        ("FP4", "int4"),
        ("FP1", "1-bit"),
        ("F64", "F32"),
        ("Q3", "unknown target dtype"),
    ],
)
def test_target_dtype_refused_with_reason(requested, why):
    with pytest.raises(KvcdnError, match=why):
        codec.normalize_target_dtype(requested)


def test_role_of_names():
    assert role_of("key") == KEY
    assert role_of("value") == VALUE
    assert role_of("latent") == KEY
    assert role_of("rotary_key") == KEY
