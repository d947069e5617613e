"""In-place ops and writes through views: every write is seen by the base and every other view,
exactly as in eager PyTorch (which is the oracle: each case runs on CPU and on xshard)."""

import pytest
import torch

import xshard
import xshard.spmd as xs
from core_testing import DEV, assert_same, check, counting


def base():
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


# Each case mutates its input through views and returns the views it made; ``check`` compares the
# returned views and the (mutated) input with eager.
def slice_write(x):
    v = x[1:3, 2:5]
    v.mul_(10)
    return v, x[1]


def slice_with_step(x):
    v = x[:, ::2]
    v.fill_(-1)
    return v


def select_write(x):
    r = x[2]
    r.add_(100)
    c = x.select(1, 3)
    c.zero_()
    return r, c


def narrow_write(x):
    v = x.narrow(1, 1, 3)
    v.sub_(5)
    return v


def view_reshape_write(x):
    v = x.view(2, 12)
    v[1].fill_(3)
    r = x.reshape(24)
    r[0] = 42
    f = x.flatten()
    return v, r, f


def transpose_write(x):
    t = x.t()
    t[0].fill_(7)
    tt = x.transpose(0, 1)
    tt[:, 1] += 1
    return t, tt


def permute_write(x):
    y = x.view(2, 2, 6)
    p = y.permute(2, 0, 1)
    p[0, 1, 0] = -9
    p.mul_(2)
    return p


def diagonal_write(x):
    d = x.diagonal()
    d.fill_(0)
    d2 = x.diagonal(offset=1)
    d2 += 100
    return d, d2


def unsqueeze_squeeze_write(x):
    u = x.unsqueeze(0)
    u[0, 0, 0] = 99
    s = u.squeeze(0)
    s[3].zero_()
    return u, s


def chunk_write(x):
    a, b = x.chunk(2, dim=1)
    a.fill_(1)
    b[0] = 2
    return a, b


def unbind_write(x):
    rows = x.unbind(0)
    rows[1].mul_(-1)
    rows[3][2] = 5
    return rows


def split_write(x):
    parts = x.split([1, 2, 3], dim=1)
    parts[2].add_(0.5)
    return parts


def nested_views(x):
    v = x[1:].t()[2:4].narrow(1, 0, 2)
    v.copy_(torch.full_like(v, 8))
    w = x.view(4, 3, 2)[:, 1].select(1, 0)
    w.add_(1000)
    return v, w


def other_views_see_write(x):
    a = x[0]
    b = x[:, 0]
    c = x.view(-1)
    x[0, 0] = -1
    b.mul_(3)
    return a, b, c


def setitem_int(x):
    x[0] = 5
    x[1, 2] = -3
    x[-1, -1] = 11
    x[2][3] = 4
    return x[0]


def setitem_mask(x):
    x[x > 15] = 0
    x[x.fmod(3) == 0] += 1
    return x.clone()


def setitem_index_tensor(x):
    idx = torch.tensor([0, 2], device=x.device)
    x[idx] = -2
    x[:, torch.tensor([1, 5], device=x.device)] = torch.tensor([7.0, 8.0], device=x.device)
    x[torch.tensor([3], device=x.device), torch.tensor([4], device=x.device)] = 99
    return x[1]


def setitem_on_view(x):
    v = x[1:]
    v[v > 10] = -5
    v[:, 0] = torch.tensor([1.0, 2.0, 3.0], device=x.device)
    return v


def index_put_accumulate(x):
    idx = torch.tensor([0, 0, 2], device=x.device)
    x.index_put_((idx,), torch.ones(3, 6, device=x.device), accumulate=True)
    return x[0]


def masked_fill_and_friends(x):
    x.masked_fill_(x < 3, -1.0)
    x.clamp_(max=20)
    x[1:3].copy_(torch.ones(2, 6, device=x.device))
    x.index_fill_(1, torch.tensor([2], device=x.device), 0.5)
    return x[0]


def inplace_ops_on_base(x):
    x.add_(1).mul_(2)
    x.sub_(x[0].clone())
    x.div_(3)
    x.pow_(2)
    x.neg_()
    x.abs_()
    x.sqrt_()
    x.addcmul_(x, x, value=0.5)
    x.lerp_(torch.zeros_like(x), 0.25)
    return x[0]


def write_base_seen_by_view(x):
    v = x[1:3, 1:3]
    t = x.t()
    x.fill_(1)
    x[2, 2] = 7
    return v, t


def swap_rows(x):
    tmp = x[0].clone()
    x[0] = x[3]
    x[3] = tmp
    return x[0]


def as_strided_write(x):
    v = x.as_strided((2, 2), (6, 1), 1)
    v.fill_(-4)
    return v


def as_strided_of_views(x):
    """as_strided indexes the storage whatever tensor it is called on (a transposed view, a
    slice, a transposed copy): xshard indexed the tensor's own elements."""
    t = x.t().as_strided((3, 3), (1, 4), 2)
    s = x[1:, ::2].as_strided((2, 2), (6, 1), 3)
    c = x.t().clone()
    x[1:].as_strided((3, 3), (1, 6), 2).add_(100)
    return t.clone(), s.clone(), c.as_strided((2, 3), (1, 4), 5), c.t()[1:].as_strided((2,), (5,))


def expand_read(x):
    e = x[0:1].expand(3, 6)
    x[0, 0] = 77
    return e.clone()


def unfold_read(x):
    u = x.unfold(1, 2, 2)
    x[0, 1] = -7
    return u.clone()


def out_argument(x):
    out = torch.empty(4, 6, device=x.device)
    torch.add(x, 1, out=out)
    torch.mul(x[0], 2, out=x[1])
    joined = torch.empty(8, 6, device=x.device)
    torch.cat([x, x], 0, out=joined)  # a list argument, its dim the default: was taken for a factory
    return out, joined


CASES = [slice_write, slice_with_step, select_write, narrow_write, view_reshape_write,
         transpose_write, permute_write, diagonal_write, unsqueeze_squeeze_write, chunk_write,
         unbind_write, split_write, nested_views, other_views_see_write, setitem_int, setitem_mask,
         setitem_index_tensor, setitem_on_view, index_put_accumulate, masked_fill_and_friends,
         inplace_ops_on_base, write_base_seen_by_view, swap_rows, as_strided_write,
         as_strided_of_views, expand_read,
         unfold_read, out_argument]


def test_writes_through_complex_views():
    """``.real``, ``.imag``, ``view_as_real``, ``view_as_complex`` and ``conj`` alias their input,
    as in eager: each was a copy, so a write through it was lost."""
    def program(b):
        c = torch.complex(b, -b)
        r = torch.stack([b, -b], -1)
        z = torch.view_as_complex(r)
        c.imag.mul_(3)
        c.real[0] = -5
        torch.view_as_real(c)[1:, 1].add_(7)
        z.mul_(2)
        r[0].fill_(9)  # seen through z
        z.real.add_(1)  # a view of a view: seen through r
        v = c.conj()  # a view holding the conjugate
        v.mul_(2)
        v[0] = 1 + 1j
        c.conj().imag.add_(5)
        return (c, c.real, c.imag, r, z, torch.view_as_real(z), v.resolve_conj(),
                c.conj().conj(), c.conj().real)

    check(program, torch.arange(4.0))


def test_rotary_embedding_through_complex_views_sharded():
    """LLaMA's rotary embedding: pairs of features viewed as complex numbers, rotated, viewed back;
    with its gradient, over a sharded batch."""
    mesh = xs.Mesh(list(range(8)), (4, 2), ("data", "model"))

    def program(x, angles, sharded):
        x = x.clone().requires_grad_()
        if sharded:
            xs.mark_sharding(x, mesh, ("data", None, "model", None))
        rotation = torch.polar(torch.ones_like(angles), angles)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(pairs * rotation).flatten(3)
        (out * torch.arange(out.shape[-1], device=x.device)).sum().backward()
        return out.detach(), x.grad

    x, angles = torch.randn(4, 6, 2, 8), torch.randn(6, 1, 4)
    want = program(x, angles, False)
    for sharded in (False, True):
        assert_same(program(x.to(DEV), angles.to(DEV), sharded), want, rtol=1e-5, atol=1e-5)


def test_gradients_through_complex_views():
    def program(b):
        b = b.clone().requires_grad_()
        c = torch.complex(b, 2 * b)
        loss = (c.real * c.imag).sum() + torch.view_as_real(c * c).pow(2).sum()
        loss.backward()
        return loss.detach(), b.grad

    check(program, torch.linspace(-1, 1, 5))


def test_as_strided_out_of_bounds_raises():
    """Eager refuses sizes and strides that reach past the storage; xshard read garbage."""
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.arange(10).as_strided((2, 2), (1, 2), 10)
    x = torch.arange(10).to(DEV)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 10"):
        x.as_strided((2, 2), (1, 2), 10)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 10"):
        x[2:].as_strided((9,), (1,))  # the view's own offset, 2, is the default
    assert_same(x[2:].as_strided((8,), (1,)), torch.arange(10)[2:].as_strided((8,), (1,)))


@pytest.mark.filterwarnings("ignore:xshard has no lowering")
def test_results_run_on_cpu_keep_eagers_strides():
    # nonzero runs on CPU (its shape depends on the values) and returns a column-major result:
    # its strides, what as_strided reads and whether view(-1) is allowed are eager's.
    x = torch.tensor([[1, 0, 2], [1, 1, 0]])
    d = x.to(DEV).nonzero()
    e = x.nonzero()
    assert d.stride() == e.stride() == (1, 4) and not d.is_contiguous()
    assert_same(d, e)
    assert_same(d.as_strided((3,), (1,)), e.as_strided((3,), (1,)))
    assert_same(d.as_strided((2, 2), (2, 1), 1), e.as_strided((2, 2), (2, 1), 1))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        d.view(-1)
    assert_same(d.reshape(-1), e.reshape(-1))
    assert (d + 1).stride() == (e + 1).stride()
    one = torch.tensor([0, 3, 0, 4])  # (2, 1): a size-1 dim's stride is free
    assert_same(one.to(DEV).nonzero().as_strided((2,), (1,)), one.nonzero().as_strided((2,), (1,)))


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_mutation_through_views(case):
    check(case, base())


@pytest.mark.parametrize("case", [slice_write, transpose_write, diagonal_write, unbind_write],
                         ids=lambda f: f.__name__)
def test_views_across_sync(case):
    """Views made before a sync still alias their base after it."""
    cpu = base()
    expected = case(cpu)
    d = base().to(DEV)
    views = d.t()[1:], d[2]
    xshard.sync()
    got = case(d)
    xshard.sync()
    assert_same(got, expected)
    assert_same(d, cpu)
    assert_same(views[0], cpu.t()[1:])
    assert_same(views[1], cpu[2])


def test_view_of_view_written_after_sync():
    x = base().to(DEV)
    v = x[1:3]
    w = v.t()
    xshard.sync()
    w[0] = -1
    xshard.sync()
    v.mul_(2)
    ref = base()
    ref[1:3].t()[0] = -1
    ref[1:3].mul_(2)
    assert_same(x, ref)
    assert_same(w, ref[1:3].t())


def test_detach_aliases_its_source():
    x = torch.randn(3, 3).to(DEV).requires_grad_()
    d = x.detach()
    d[0, 0] = 5.0
    assert x[0, 0].item() == 5.0
    with torch.no_grad():
        x.mul_(2)
    assert d[0, 0].item() == 10.0
    assert not d.requires_grad


def test_views_report_aliasing_metadata():
    x = base().to(DEV)
    v = x[1:, 2:]
    assert v.shape == (3, 4) and v.stride() == (6, 1) and v.storage_offset() == 8
    assert x.t().stride() == (1, 6) and not x.t().is_contiguous()
    assert v._base is x
    assert x.view(6, 4)._base is x


def test_contiguous_and_clone_do_not_alias():
    x = base().to(DEV)
    c = x.t().contiguous()
    k = x.clone()
    x.fill_(0)
    assert_same(c, base().t().contiguous())
    assert_same(k, base())


def test_inplace_dtype_rules():
    i = torch.arange(4, dtype=torch.int32).to(DEV)
    i.add_(2)
    i.mul_(3)
    assert_same(i, (torch.arange(4, dtype=torch.int32) + 2) * 3)
    with pytest.raises(RuntimeError, match="can't be cast|Promotion of int"):
        i.add_(0.5)
    f = torch.zeros(3, dtype=torch.float16).to(DEV)
    f.add_(torch.ones(3, dtype=torch.float64).to(DEV))
    assert_same(f, torch.ones(3, dtype=torch.float16))
    b = torch.zeros(3, 4).to(DEV)
    b.add_(torch.arange(4.0).to(DEV))  # broadcasts into self
    assert_same(b, torch.zeros(3, 4) + torch.arange(4.0))


def test_copy_between_dtypes_and_from_cpu():
    x = torch.zeros(2, 3, dtype=torch.int64).to(DEV)
    x.copy_(torch.tensor([[1.7, -2.2, 3.9]]))  # from CPU, broadcast, float -> int truncation
    assert_same(x, torch.tensor([[1, -2, 3], [1, -2, 3]]))
    x[0].copy_(torch.tensor([9, 8, 7], dtype=torch.uint8).to(DEV))
    assert_same(x, torch.tensor([[9, 8, 7], [1, -2, 3]]))
    cpu = torch.empty(2, 3, dtype=torch.int64)
    cpu.copy_(x)
    assert torch.equal(cpu, x.cpu())


def test_cpu_index_tensors_index_and_assign_into_device_tensors():
    """As on CUDA: an index tensor may live on the CPU (it is moved to the device)."""
    base = torch.arange(20.0).reshape(5, 4)
    idx = torch.tensor([0, 2, 4])
    cols = torch.tensor([[1], [3]])
    checks = [
        lambda x: x[idx],
        lambda x: x[idx, 1],
        lambda x: x[:, torch.tensor([3, 0])],
        lambda x: x[cols],
        lambda x: torch.index_select(x, 0, idx.to(x.device)),
    ]
    d = base.to(DEV)
    with counting() as counts:
        for fn in checks:
            assert_same(fn(d), fn(base))
    assert not counts["cpu_fallbacks"]
    for kind in ("assign", "add", "index_put_", "accumulate"):
        x, y = base.clone(), base.clone().to(DEV)
        for t in (x, y):
            if kind == "assign":
                t[idx] = torch.full((3, 4), -1.0).to(t.device)
            elif kind == "add":
                t[idx] += 1.0
            elif kind == "index_put_":
                t.index_put_((idx, torch.tensor([1, 1, 2])), torch.tensor(9.0))
            else:
                t.index_put_((torch.tensor([1, 1, 3]),), torch.ones(4).to(t.device),
                             accumulate=True)
        assert_same(y, x)


def test_data_assignment_takes_the_other_tensors_storage():
    # ``p.data = t`` was silently ignored on xshard tensors: p kept its old value.
    def run(device):
        p = torch.nn.Parameter(torch.ones(2, 3, device=device))
        t = torch.arange(8.0, device=device)
        p.data = t[::2]  # a view: p now shares t's storage, strided
        t.add_(1)  # seen by p
        out = [p.detach().clone(), p.stride(), p.requires_grad, p.is_leaf]
        p.data = torch.zeros(3, dtype=torch.float64, device=device)
        out += [p.dtype, tuple(p.shape)]
        loss = (p * 2).sum()
        loss.backward()
        out.append(p.grad.clone())
        return out

    cpu, dev = run("cpu"), run(DEV)
    assert_same(dev[0], cpu[0])
    assert dev[1:6] == cpu[1:6] == [(2,), True, True, torch.float64, (3,)]
    assert_same(dev[6], cpu[6])
    p = torch.ones(2, device=DEV)
    with pytest.raises(TypeError, match=r"\.to\(xshard.device\(\)\)"):
        p.data = torch.zeros(2)


# resize_ and set_ change the tensor itself: its sizes, strides, offset and which storage it
# shares. Each case returns tensors whose values and metadata are compared with eager's.
def resize_smaller_keeps_the_storage(d):
    t = torch.arange(12.0, device=d)
    v = t[2:]
    t.resize_(2, 3)
    t.mul_(10)  # seen by v: the same storage
    return t, v


def resize_then_grow_keeps_the_first_elements(d):
    t = torch.arange(6.0, device=d)
    t.resize_(2, 2)
    t.resize_(2, 3)  # within the storage: its elements are the old ones
    return (t + 1,)


def resize_grows_an_empty_tensor(d):
    t = torch.empty(0, device=d)
    t.resize_(4, 5)
    t.fill_(2.0)
    return (t * 3,)


def resize_with_a_memory_format(d):
    t = torch.arange(24.0, device=d)
    t.resize_(1, 2, 3, 4, memory_format=torch.channels_last)
    u = torch.arange(6.0, device=d)
    u.resize_as_(torch.ones(2, 2, device=d))
    return t, t.contiguous(), u


def resize_a_view_with_an_offset(d):
    t = torch.arange(6.0, device=d)
    v = t[2:]
    v.resize_(2, 2)  # from its offset, to the storage's end
    v.add_(1)
    return v, t


def set_to_another_tensor(d):
    t = torch.arange(6.0, device=d)
    o = torch.ones(3, 4, device=d)
    t.set_(o)
    t.add_(1)  # seen by o
    e = torch.arange(3.0, device=d)
    e.set_()
    return t, o, e, e + 1


def set_to_a_window_of_another_tensor(d):
    t = torch.arange(6.0, device=d)
    o = torch.arange(12.0, device=d)
    t.set_(o, 2, (2, 3), (1, 2))
    t.mul_(-1)  # seen by o
    s = torch.arange(12.0, device=d)
    s.set_(s.untyped_storage(), 1, (3, 2))
    return t, o, s * 1


@pytest.mark.parametrize("case", [
    resize_smaller_keeps_the_storage, resize_then_grow_keeps_the_first_elements,
    resize_grows_an_empty_tensor, resize_with_a_memory_format, resize_a_view_with_an_offset,
    set_to_another_tensor, set_to_a_window_of_another_tensor], ids=lambda f: f.__name__)
def test_resize_and_set_as_eager(case):
    """resize_ and set_ used to run on CPU and leave the tensor's recorded shape behind: the next
    op failed with an internal LoweringError."""
    with counting() as delta:
        dev = case(DEV)
    want = case(torch.device("cpu"))
    assert delta["cpu_fallbacks"] == {}
    for got, expected in zip(dev, want, strict=True):
        assert (got.shape, got.stride(), got.storage_offset()) == \
            (expected.shape, expected.stride(), expected.storage_offset())
        assert_same(got, expected)


def test_resize_beyond_a_shared_storage_is_refused():
    """Growing a storage that other tensors share would leave them on the old one: refused."""
    t = torch.arange(6.0, device=DEV)
    view = t[1:]
    with pytest.raises(RuntimeError, match=r"resize_ to \[4, 4\] needs 16 elements of storage "
                                           r"and this tensor's holds 6.*t.clone\(\) first"):
        t.resize_(4, 4)
    assert_same(view, torch.arange(1.0, 6.0))
    with pytest.raises(RuntimeError, match=r"resize_ to \[8\] needs 9 elements"):
        view.resize_(8)  # its base shares the storage
    t.resize_(2, 3)  # within the storage: shared as in eager
    assert_same(t, torch.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match=r"set_ of an xshard tensor to a UntypedStorage"):
        t.set_(torch.zeros(3).untyped_storage())

