"""Every dtype keeps its exact type and values through arithmetic, casts, reductions and comparisons,
with PyTorch's promotion rules (eager CPU is the oracle)."""

import pytest
import torch

import xshard
from core_testing import DEV, assert_same, check

DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64, torch.float32,
          torch.bfloat16, torch.float16]
FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.uint8]


def values(dtype, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype is torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, dtype=dtype)
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-100, 100, (n,), generator=g, dtype=dtype)
    return (torch.randn(n, generator=g) * 4).to(dtype)


def nonzero(dtype, n=12, seed=1):
    v = values(dtype, n, seed)
    if dtype is torch.bool:
        return torch.ones(n, dtype=dtype)
    return torch.where(v == 0, torch.ones((), dtype=dtype), v)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d is not torch.bool], ids=str)
def test_arithmetic(dtype):
    a, b = values(dtype), nonzero(dtype)
    check(lambda x, y: (x + y, x - y, x * y, x / y, -x if dtype is not torch.uint8 else x,
                        x * 2, x + 3, torch.maximum(x, y), torch.abs(x)), a, b)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integer_division_and_remainder(dtype):
    a, b = values(dtype), nonzero(dtype)
    check(lambda x, y: (x // y, x % y, torch.div(x, y, rounding_mode="trunc"),
                        torch.div(x, y, rounding_mode="floor"), torch.fmod(x, y)), a, b)


@pytest.mark.parametrize("dtype", INTS + [torch.bool], ids=str)
def test_bitwise(dtype):
    a, b = values(dtype), values(dtype, seed=3)
    check(lambda x, y: (x & y, x | y, x ^ y, ~x), a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_comparisons_and_where(dtype):
    a, b = values(dtype), values(dtype, seed=5)
    check(lambda x, y: (x == y, x != y, x < y, x >= y, torch.where(x > y, x, y),
                        torch.eq(x, x)), a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reductions(dtype):
    a = values(dtype).view(3, 4)
    fns = [lambda x: x.sum(), lambda x: x.sum(0), lambda x: x.amax(1), lambda x: x.amin(),
           lambda x: x.any(), lambda x: x.all(1), lambda x: x.prod(0)]
    if dtype is not torch.bool:
        fns.append(lambda x: x.argmax(1))
    if dtype.is_floating_point:
        fns += [lambda x: x.mean(1), lambda x: x.cumsum(1), lambda x: x.std(0)]
    tol = dict(rtol=1e-2, atol=1e-2) if dtype in (torch.bfloat16, torch.float16) else {}
    check(lambda x: tuple(f(x) for f in fns), a, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sort_and_topk_order(dtype):
    # Descending order of integers by negation overflowed: uint8 0 sorted first, and the most
    # negative int64 above everything. Ties among repeated values keep their order (stable).
    a = torch.cat([values(dtype), values(dtype)[:4]])
    a[2] = 0  # -0 is 0 in uint8: it sorted first descending
    if dtype in (torch.int64, torch.int32):
        a[0], a[1] = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    fns = [lambda x: torch.sort(x, stable=True), lambda x: torch.sort(x, descending=True,
                                                                       stable=True),
           lambda x: torch.argsort(x, descending=True, stable=True)]
    if dtype is not torch.bool:  # eager has no topk of bools; which of tied elements: unspecified
        fns += [lambda x: torch.topk(x, 5).values, lambda x: torch.topk(x, 5, largest=False).values]
    check(lambda x: tuple(f(x) for f in fns), a)
    if dtype is not torch.bool:
        top = torch.topk(a.to(DEV), 5, largest=False)
        assert torch.equal(a[top.indices.cpu()], top.values.cpu())


@pytest.mark.parametrize("src", DTYPES, ids=str)
def test_casts_between_all_dtypes(src):
    a = values(src)
    if src.is_floating_point:  # keep float -> unsigned/narrow int casts defined (in range)
        a = a.abs().clamp(max=120)
    check(lambda x: tuple(x.to(dst) for dst in DTYPES), a)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_float_math(dtype):
    a, b = values(dtype), nonzero(dtype).abs()
    tol = dict(rtol=1e-2, atol=1e-2) if dtype in (torch.bfloat16, torch.float16) else {}
    check(lambda x, y: (x.exp().clamp(max=100), y.log(), y.sqrt(), x.sin(), x.tanh(),
                        x.sigmoid(), x.floor(), x.round(), x.pow(2), torch.softmax(x, 0)),
          a, b, **tol)


def test_int64_precision_through_ops():
    big = torch.tensor([2**53 + 1, -(2**53) - 3, 2**62 - 1, 12345678901234], dtype=torch.int64)
    check(lambda x: (x + 1, x - 2**40, x * 1, x.sum(), x.cumsum(0), x.max(), x.sort().values,
                     x[x > 0], x.abs(), x // 7, x % 1000, x.view(2, 2).t().contiguous()), big)
    d = big.to(DEV)
    assert d.tolist() == big.tolist()
    assert (d[2] + 0).item() == 2**62 - 1


def test_uint8_wraps_like_eager():
    a = torch.tensor([250, 5, 128], dtype=torch.uint8)
    check(lambda x: (x + 10, x * 3, x - 6, x.sum(), x.to(torch.int8)), a)


def test_float16_bfloat16_rounding_matches_eager():
    a = torch.tensor([1.0, 1 / 3, 65504.0, 1e-4, 3.14159, -2.71828])
    for dtype in (torch.float16, torch.bfloat16):
        check(lambda x: (x.to(dtype), x.to(dtype) * 3, x.to(dtype).to(torch.float32)), a)


def test_mixed_dtype_promotion_table():
    pairs = [(x, y) for x in DTYPES for y in DTYPES]
    for x_dt, y_dt in pairs:
        a, b = values(x_dt, 4), values(y_dt, 4, seed=9)
        expected = a + b if torch.bool not in (x_dt, y_dt) or x_dt != y_dt else a | b
        got = a.to(DEV) + b.to(DEV) if torch.bool not in (x_dt, y_dt) or x_dt != y_dt \
            else a.to(DEV) | b.to(DEV)
        assert got.dtype == expected.dtype, (x_dt, y_dt)
    xshard.sync()


def test_default_dtype_and_scalar_types():
    d = torch.tensor([1, 2, 3], device=DEV)
    assert (d * 1.5).dtype == torch.float32
    assert (d.float() * torch.tensor(1.5, dtype=torch.float64)).dtype == torch.float32
    assert (d / 2).dtype == torch.float32
    assert_same(d.float().mean(), torch.tensor(2.0))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.ones(2, device=DEV).dtype == torch.float64
        assert_same(torch.arange(3.0, device=DEV), torch.arange(3.0))
    finally:
        torch.set_default_dtype(prev)


INTEGERS_TO_FLOAT = {
    "div": lambda a: a / 3,
    "div(7)": lambda a: a.div(7),
    "sqrt": torch.sqrt,
    "atan2": lambda a: torch.atan2(a, a + 2),
    "sigmoid": torch.sigmoid,
    "log1p": torch.log1p,
    "where(c, 1.1, 2.2)": lambda a: torch.where(a > 1, 1.1, 2.2),
}


@pytest.mark.parametrize("op", INTEGERS_TO_FLOAT)
def test_integers_to_default_float64_in_float64(op):
    """Under ``torch.set_default_dtype(torch.float64)``, ops taking integers to the default float
    dtype computed in float32 and cast the result to float64 (``int / 3`` differed from eager by
    2e-8)."""
    fn = INTEGERS_TO_FLOAT[op]
    a = torch.tensor([1, 2, 5], dtype=torch.int64)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert_same(fn(a.to(DEV)), fn(a), rtol=1e-15, atol=0)  # float32's: 1e-8 apart
    finally:
        torch.set_default_dtype(prev)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_half_norms_accumulate_in_float32(dtype, p):
    """|x|**p of float16 values near 300 overflows float16: ATen's norms accumulate in float32
    (xshard's returned inf, and F.normalize zeros)."""
    x = torch.tensor([300.0, 400.0, 1.0], dtype=dtype)
    d = x.to(xshard.device())
    torch.testing.assert_close(d.norm(p=p).cpu(), x.norm(p=p))
    torch.testing.assert_close(torch.nn.functional.normalize(d, dim=0).cpu(),
                               torch.nn.functional.normalize(x, dim=0))
    torch.testing.assert_close(torch._foreach_norm([d], p)[0].cpu(), torch._foreach_norm([x], p)[0])


IN_PLACE_CASTS = {
    "bool.mul_(3)": lambda i, b, f: b.mul_(3),
    "int.div_(2)": lambda i, b, f: i.div_(2),
    "int.mul_(1.5)": lambda i, b, f: i.mul_(1.5),
    "int.addcmul_(float, float)": lambda i, b, f: i.addcmul_(f, f),
    "_foreach_mul_([int], 1.5)": lambda i, b, f: torch._foreach_mul_([i], 1.5),
    "int.sqrt_()": lambda i, b, f: i.sqrt_(),
    # allowed: the result casts to the written dtype
    "float.eq_(int)": lambda i, b, f: f.eq_(i),
    "int.masked_fill_(bool, 1.5)": lambda i, b, f: i.masked_fill_(b, 1.5),
    "half.add_(float)": lambda i, b, f: f.half().add_(f),
    "int.cumsum_(0)": lambda i, b, f: i.int().cumsum_(0),  # computes in the input's dtype
    "bool0d.cumsum_(0)": lambda i, b, f: b[0].cumsum_(0),
}


@pytest.mark.parametrize("name", list(IN_PLACE_CASTS))
def test_in_place_result_cast_as_eager(name):
    """An in-place op whose result dtype cannot be written into its input raises as in eager (the
    meta kernels let ``bool.mul_(3)`` and ``int.div_(2)`` through: xshard wrote a cast result)."""
    fn = IN_PLACE_CASTS[name]
    inputs = (torch.tensor([-7, -1, 2, 3]), torch.tensor([True, False, True, True]),
              torch.tensor([0.5, 1.5, -2.0, 3.0]))
    try:
        fn(*[t.clone() for t in inputs])
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type|"
                                               "Attempting to cast from"):
            fn(*[t.to(DEV) for t in inputs])
        assert "can't be cast" in str(e)
    else:
        check(fn, *inputs)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("largest", [True, False])
def test_topk_ranks_every_nan_highest(dtype, largest):
    """NaNs from sqrt / log of negatives carry the sign bit, which lax.top_k ranks below every
    number: ``sqrt(x).topk(3)`` left them out where eager ranks NaN above everything."""
    x = torch.tensor([1.0, -1.0, 4.0, float("inf"), 9.0, -2.0, 0.25, -float("inf"), 0.0, -0.0])
    for fn in (lambda t: t.sqrt(), lambda t: t.log(), lambda t: t * 0 / 0 + t):
        expected = fn(x.to(dtype)).topk(4, largest=largest)
        got = fn(x.to(dtype).to(DEV)).topk(4, largest=largest)
        torch.testing.assert_close(got.values.cpu(), expected.values, equal_nan=True)


u8, m = torch.uint8, [True, False, True]
# (what runs, on a device): eager refuses each (c10's checked conversion of the number to the
# result's dtype); the meta kernels take them, and XLA wrapped 300 to 44 (silent wrong answer).
_OUT_OF_RANGE = {
    "u8.fill_(300)": lambda d: torch.zeros(3, dtype=u8, device=d).fill_(300),
    "i8.fill_(-129)": lambda d: torch.zeros(3, dtype=torch.int8, device=d).fill_(-129),
    "u8.fill_(-1.0)": lambda d: torch.zeros(3, dtype=u8, device=d).fill_(-1.0),
    "i32.fill_(2**40)": lambda d: torch.zeros(2, dtype=torch.int32, device=d).fill_(2**40),
    "f16.fill_(1e6)": lambda d: torch.zeros(2, dtype=torch.float16, device=d).fill_(1e6),
    "f32.fill_(1e39)": lambda d: torch.zeros(2, device=d).fill_(1e39),
    "u8[0] = 300": lambda d: torch.zeros(3, dtype=u8, device=d).__setitem__(0, 300),
    "masked_fill": lambda d: torch.zeros(3, dtype=u8, device=d).masked_fill(
        torch.tensor(m, device=d), 300),
    "full": lambda d: torch.full((3,), 300, dtype=u8, device=d),
    "new_full": lambda d: torch.zeros(3, dtype=u8, device=d).new_full((2,), 256),
    "index_fill": lambda d: torch.zeros(3, dtype=u8, device=d).index_fill(
        0, torch.tensor([1], device=d), 300),
    "clamp": lambda d: torch.full((2,), 7, dtype=u8, device=d).clamp(max=300),
    "clamp_": lambda d: torch.full((2,), 7, dtype=u8, device=d).clamp_(max=-300),
    "where": lambda d: torch.where(torch.tensor(m, device=d), torch.zeros(3, dtype=u8, device=d),
                                   300),
    "addcmul": lambda d: torch.zeros(2, dtype=u8, device=d).addcmul(
        torch.ones(2, dtype=u8, device=d), torch.ones(2, dtype=u8, device=d), value=300),
}


@pytest.mark.parametrize("case", list(_OUT_OF_RANGE))
def test_numbers_out_of_the_results_range_are_refused_as_in_eager(case):
    program = _OUT_OF_RANGE[case]
    with pytest.raises(RuntimeError, match="without overflow"):
        program("cpu")
    with pytest.raises(RuntimeError, match="without overflow"):
        program(DEV)


def test_numbers_eager_converts_without_overflow():
    """Those eager takes: a negative integer into an unsigned dtype wraps (down to minus its
    maximum), bool takes any number, infinity fits a float, a float bound promotes."""
    check(lambda x, h, b: (x.clone().fill_(-1), x.clone().fill_(-255), b.clone().fill_(2),
                           h.clone().fill_(float("inf")), x.clamp(max=300.5),
                           x.clone().clamp_(min=-1), torch.where(b, x, 1.5),
                           x.masked_fill(b, -3)),
          torch.arange(3, dtype=u8), torch.zeros(3, dtype=torch.float16),
          torch.tensor(m))
