"""The xshard tensor, and the dispatcher: what ``XTensor.__torch_dispatch__`` does with an aten call.

The path of one call (its route comes from the op's facts, xshard.core.ops):

1. special ops (copies, transfers, reads, aliases, in-place view ops) have their own handler;
2. ops that write an argument (``add_``, ``out=``, running-stat updates) are computed through their
   functional twin, and the result is written into the argument (xshard.core.record);
3. view ops make a tensor sharing the base's cell, one view step further (xshard.core.cells);
4. functional ops with a lowering rule become a node (xshard.core.record);
5. ops without a rule run PyTorch's own decomposition for them, which records simpler ops;
6. as a last resort an op runs eagerly on CPU (xshard.core.fallback).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._pytree import tree_map

from xshard.core import ir, ops, record, trace, transfer
from xshard.core.backend import DEVICE
from xshard.core.cells import Cell, LazyTensor, contiguous_strides
from xshard.core.execute import to_cpu
from xshard.core.fallback import cpu_fallback

aten = torch.ops.aten
_TENSOR_DATA = torch._C.TensorBase.data  # the getter and setter of ``Tensor.data``



_PROXY = torch._C._TorchDispatchModeKey.PROXY


class TracingError(RuntimeError):
    """An xshard tensor reached a tracer that cannot record it (make_fx's proxy mode)."""

class XTensor(LazyTensor):
    """A tensor on the xshard device. Its value is ``self._cell.value`` seen through ``self._chain``
    (see [Note: cells and views] in xshard.core.cells)."""

    @staticmethod
    def __new__(cls, cell: Cell, chain: tuple, shape, stride, dtype, requires_grad=False,
                storage_offset=0):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=storage_offset, dtype=dtype, device=DEVICE,
            requires_grad=requires_grad)
        t._cell = cell
        t._chain = chain
        t._cache = None
        t._cache_version = -1
        # What the recorder keys a call on, per tensor argument (see xshard.core.record).
        t._meta = (tuple(shape), tuple(stride), dtype)
        return t

    def __init__(self, *args, **kwargs):
        pass

    # ``t.data = other``: PyTorch copies ``other``'s sizes, strides and storage into ``t``'s
    # TensorImpl, which for a wrapper subclass leaves the value (``_cell``, ``_chain``) as it was,
    # so the assignment did nothing. Here ``t`` shares ``other``'s storage and view, as in eager.
    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, other):
        if isinstance(other, torch.Tensor) and not isinstance(other, LazyTensor):
            raise TypeError(
                f"tensor.data = ... on an xshard tensor needs an xshard tensor, got a tensor on "
                f"{other.device}; move it first: t.data = other.to(xshard.device()).")
        _TENSOR_DATA.__set__(self, other)  # sizes, strides, dtype; raises for a non-tensor
        self._cell, self._chain, self._meta = other._cell, other._chain, other._meta
        self._cache, self._cache_version = None, -1

    # A hook's Python error would abort the process (see [Note: errors in backward]): it is
    # raised by backward() instead, once the graph's nodes have run.
    def register_hook(self, hook):
        return super().register_hook(_deferring(hook))

    def register_post_accumulate_grad_hook(self, hook):
        return super().register_post_accumulate_grad_hook(_deferring(hook))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if torch._C._get_dispatch_mode(_PROXY) is not None:
            raise TracingError(
                f"{func} on an xshard tensor inside make_fx's proxy mode (torch.fx's make_fx, "
                f"torch.func.linearize, torch.export, AOT autograd): the mode hands xshard tensors "
                f"to xshard, which records the op lazily where the tracer cannot see it, so the "
                f"traced graph would return the values of this call whatever its inputs. Trace "
                f"with CPU or meta tensors, or compile a step on xshard with xshard.compile.")
        try:
            return dispatch(func, args, kwargs or {})
        except Exception as e:
            if _graph_task_id() < 0 or not _called_by_engine(sys._getframe(0).f_back):
                raise
            return _raised_in_backward(func, args, kwargs or {}, e)

    def __repr__(self, *, tensor_contents=None):
        text = repr(to_cpu(self))
        suffix = f", device='{self.device}'"
        if text.endswith(")"):
            text = text[:-1] + suffix + ")"
        if self.requires_grad and "requires_grad" not in text:
            text = text[:-1] + ", requires_grad=True)"
        return text

    def set_(self, *args, **kwargs):
        # PyTorch passes set_(other, offset, size, stride) on as other's storage object, whose
        # data xshard cannot find: the same call made with a view of other (see _set_).
        bound = dict(zip(("source", "storage_offset", "size", "stride"), args), **kwargs)
        source, offset = bound.get("source"), bound.get("storage_offset")
        if isinstance(source, XTensor) and offset is not None:
            size = bound["size"]
            return super().set_(source.as_strided(size, bound.get("stride") or
                                                  contiguous_strides(size), offset))
        return super().set_(*args, **kwargs)

    def tolist(self):
        # PyTorch's C tolist() refuses tensor subclasses; read the value and convert on the host.
        return to_cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                f"copy the tensor to host memory first.")
        return self.detach().cpu().numpy()

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new._cell.sharding = self._cell.sharding
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, val in self.__dict__.items():
            if key not in ("_cell", "_chain", "_cache", "_cache_version", "_meta"):
                setattr(new, key, copy.deepcopy(val, memo))
        return new

    # [Note: tied parameters] Being a "traceable wrapper subclass" makes Module._apply (behind
    # model.to(device)) swap each parameter object in place instead of replacing it, so parameters
    # shared between modules (tied embeddings) stay one parameter on the device.
    def __tensor_flatten__(self):
        return [], (self._cell, self._chain, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        cell, chain, dtype = ctx
        return XTensor(cell, chain, outer_size, outer_stride, dtype)

    # [Note: saving device tensors] As PyTorch saves a tensor of a storage-less PrivateUse1 device:
    # its CPU copy under PyTorch's own rebuild function, which weights_only loading allows and which
    # honours map_location. The file needs no xshard to load with map_location="cpu", and loads
    # onto the xshard device where xshard is installed.
    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (to_cpu(self), self.dtype, str(self.device), self.requires_grad))

    # [Note: DCP's default stager] dcp.async_save copies the state to the host with a stager that
    # takes a tensor whose data_ptr() is 0 and is not a plain tensor for a wrapper of inner
    # tensors: it allocates an uninitialised CPU tensor and copies the wrapper's attributes onto
    # it. An xshard tensor keeps its values on the devices, so the checkpoint would hold garbage;
    # the stager's first question is refused instead.
    def data_ptr(self):
        if _asked_by_dcp_stager(sys._getframe(1).f_code):
            raise RuntimeError(DCP_STAGER_ERROR)
        return super().data_ptr()


DCP_STAGER_ERROR = (
    "dcp.async_save's default stager cannot copy xshard tensors to the host (it would save "
    "uninitialised memory). Use xshard.checkpoint.async_save(state, path), or pass "
    "async_stager=torch.distributed.checkpoint.staging.BlockingAsyncStager() to dcp.async_save.")


def _asked_by_dcp_stager(code) -> bool:
    stager = sys.modules.get("torch.distributed.checkpoint._state_dict_stager")
    offload = getattr(getattr(stager, "StateDictStager", None), "_offload_tensor", None)
    return offload is not None and code is offload.__code__


def new_base(value: ir.Node, stride=None, requires_grad=False, sharding=None) -> XTensor:
    """A fresh base tensor (its own cell) holding ``value``."""
    contiguous = contiguous_strides(value.shape)
    if stride is None:
        stride = contiguous
    layout = None if tuple(stride) == contiguous else tuple(stride)
    return XTensor(Cell(value, sharding, layout), (), value.shape, stride, value.dtype,
                   requires_grad)


def _wrap(spec, node):
    kind = spec[0]
    if kind == "t":
        return new_base(node, spec[2])
    if kind == "seq":
        return spec[1]([new_base(ir.output_node(node, i), o[2]) if o[0] == "t" else o[1]
                        for i, o in enumerate(spec[2])])
    return spec[1]


# -- the dispatcher ---------------------------------------------------------------------------------


def dispatch(func, args, kwargs):
    if trace.OPEN is None:  # the first op after a sync or span boundary (see xshard.core.trace)
        trace.recording_op()
    f = ops.facts(func)
    route = f.route
    if route is ops.RECORD:
        try:
            spec, node = record.record(func, f, args, kwargs)
        except record.NoMeta:
            return _fallback(func, args, kwargs)
        out = _wrap(spec, node)
        if f.inherit_sharding:
            _inherit_sharding(args[0], out)
        return out
    if route is ops.VIEW:
        return _view(func, f, args, kwargs)
    if route is ops.MUTATING:
        out = record.mutate(func, f, args, kwargs)
        return _fallback(func, args, kwargs) if out is NotImplemented else out
    if route is ops.SPECIAL:
        return _SPECIAL[id(func)](func, args, kwargs)
    if route is ops.COMPOSITE:
        # Composite ops reach us when called from inside a decomposition or under
        # torch.inference_mode; run xshard's definition if it has one, else PyTorch's.
        own = ops.COMPOSITES.get(id(func))
        if own is not None:
            return own(*args, **kwargs)
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if f.decomposition is not None:
        try:
            out = f.decomposition(*args, **kwargs)
        except NotImplementedError as e:
            if str(e):  # an xshard refusal, with its reason: raise it
                raise
            out = NotImplemented  # PyTorch's reference does not cover these arguments
        except ZeroDivisionError:  # it divides by an element count: a mean over no element
            out = NotImplemented
        if out is not NotImplemented:
            return out
    return _fallback(func, args, kwargs)


def _fallback(func, args, kwargs):
    return cpu_fallback(func, args, kwargs, new_base)


# [Note: errors in backward]
# An op autograd's engine runs on the xshard device runs under a stream guard of PyTorch's Python
# device guard, whose destructor calls into Python. A Python exception raised by the op leaves the
# interpreter's error set while the C++ stack unwinds through that destructor, whose call then
# fails inside a noexcept function: std::terminate, the whole process gone ("terminate called
# without an active exception"), for an error that eager raises from backward(). So an op that
# raises there returns zeros of its output's shape (its meta kernel's) and the error is raised by a
# callback queued on the engine, which runs once the graph's nodes have, where the error travels
# as PyTorch's own errors do: backward() (or autograd.grad) raises it, with its type and message.
# An op a custom Function's backward calls raises as anywhere: PyTorch keeps the error apart
# before the stack unwinds. A hook's error is not kept apart (PyTorch's hook wrappers), so the
# hooks registered on xshard tensors (``register_hook``, ``register_post_accumulate_grad_hook``)
# defer theirs the same way; other hooks (on a grad_fn, a module's full backward hooks, saved
# tensor hooks) cannot be wrapped, and an error there aborts (see README, "Known limits").
_graph_task_id = torch._C._current_graph_task_id
_DEFERRED: dict = {}  # graph task id -> the first error one of its ops raised
# (PyTorch's function that calls the engine; None where a PyTorch release has another.)
_ENGINE_ENTRY = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__",
                        None)


def _called_by_engine(caller) -> bool:
    """Whether the op whose dispatch frame ``caller`` follows was called by one of the engine's
    nodes: no Python caller (an engine thread), or the call that started the engine (nodes run
    on the calling thread: reentrant backward, multithreading off)."""
    return caller is None or caller.f_code is _ENGINE_ENTRY


def _defer(error: BaseException) -> None:
    """Raises ``error`` from the running backward once its nodes have run (the first error of a
    graph task wins)."""
    task = _graph_task_id()
    if task not in _DEFERRED:
        _DEFERRED[task] = error

        def raise_deferred():
            raise _DEFERRED.pop(task)

        torch.autograd.Variable._execution_engine.queue_callback(raise_deferred)


def _deferring(hook):
    """``hook`` with an error it raises inside the autograd engine deferred (see ``_defer``); the
    gradient it would have changed is left as it is."""
    @functools.wraps(hook)
    def deferring(*args):
        try:
            return hook(*args)
        except BaseException as error:
            if _graph_task_id() < 0:
                raise
            _defer(error)
            return None

    return deferring


def _raised_in_backward(func, args, kwargs, error):
    _defer(error)
    try:
        out = func(*tree_map(record.to_meta, args), **tree_map(record.to_meta, kwargs))
    except Exception:
        # No shape to stand in with: the engine fails on the first tensor argument's instead,
        # with its own error; say which error that hides.
        warnings.warn(f"{func} raised in backward: {type(error).__name__}: {error}",
                      stacklevel=2)
        out = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if out is None:
            raise error
    return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=DEVICE)
                    if isinstance(t, torch.Tensor) else t, out)


def _inherit_sharding(source, out):
    """Copies and same-shaped peers (``clone``, ``zeros_like``) keep their input's annotation."""
    if isinstance(source, XTensor) and isinstance(out, XTensor):
        if source._cell.sharding is not None and not source._chain:
            out._cell.sharding = source._cell.sharding


def _view(func, f, args, kwargs):
    if func is aten.as_strided.default:
        args, kwargs = _on_storage(*args, **kwargs), {}
    made = record.view_steps(func, f, args, kwargs)
    if made is None:  # a view op with a tensor-valued static argument: recorded as a value
        spec, node = record.record(func, f, args, kwargs)
        return _wrap(spec, node)
    made, spec = made
    base = args[0]
    if spec[0] == "t":
        return _make_view(base, made, spec, func is not aten.as_strided.default)
    return spec[1]([_make_view(base, step, o, True) for step, o in made])


def _on_storage(t: XTensor, size, stride, storage_offset=None) -> tuple:
    """``as_strided``'s arguments taken on ``t``'s whole storage: it indexes the storage, whatever
    view it is called on (its offset defaults to the view's own)."""
    offset = t.storage_offset() if storage_offset is None else storage_offset
    storage = _storage(t)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if 0 not in tuple(size) and last >= storage.numel():
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)} and storage offset {offset} "
            f"reach element {last}, out of bounds for storage of size {storage.numel()}")
    return storage, size, stride, offset


def _storage(t: XTensor) -> XTensor:
    """``t``'s whole storage as a contiguous tensor at offset 0: its base, permuted into the order
    of its elements in memory when the base is not contiguous (``x.t().clone()``)."""
    cell = t._cell
    value = cell.value
    if t.dtype != value.dtype:
        raise NotImplementedError(
            f"xshard cannot call as_strided on a {t.dtype} view of {value.dtype} storage; call "
            f".clone() first.")
    layout = cell.layout
    root = _view_tensor(t, (), value.shape, layout or contiguous_strides(value.shape),
                        value.dtype, 0)
    if layout is None:
        return root
    order = sorted(range(len(layout)), key=lambda d: (-layout[d], d))
    storage = aten.permute.default(root, order)
    if not storage.is_contiguous():
        raise NotImplementedError(
            f"xshard cannot call as_strided on storage with gaps (strides {layout} for shape "
            f"{tuple(value.shape)}); call .contiguous() first.")
    return storage


def _make_view(base: XTensor, step, spec, relative: bool) -> XTensor:
    _, shape, stride, dtype, offset = spec
    if relative:
        # The meta kernel saw the parent at offset 0; as_strided's offset is absolute already.
        offset += base.storage_offset()
    return _view_tensor(base, base._chain + (step,), shape, stride, dtype, offset)


def _view_tensor(base: XTensor, chain, shape, stride, dtype, offset) -> XTensor:
    """A view (``chain``) of ``base``'s storage. Under torch.inference_mode a view of a normal tensor is a
    normal tensor, as in eager: autograd then shares ``base``'s version counter with it, which it
    cannot with an inference tensor ("Cannot set version_counter for inference tensor": ``w.t()``
    or ``model.state_dict()`` of a device model raised)."""
    if torch.is_inference_mode_enabled() and not base.is_inference():
        with torch.inference_mode(False):
            return XTensor(base._cell, chain, shape, stride, dtype, storage_offset=offset)
    return XTensor(base._cell, chain, shape, stride, dtype, storage_offset=offset)


def _alias(func, args, kwargs):
    t = args[0]
    return _view_tensor(t, t._chain, t.shape, t.stride(), t.dtype, t.storage_offset())


def _copy_(func, args, kwargs):
    return transfer.copy_(args[0], args[1])


def copy_from(src, dst, non_blocking=False):
    """Kernel of ``aten::_copy_from`` for the xshard device.

    ``copy_`` reaches it when the Python dispatch key is excluded, e.g. inside
    ``torch.tensor(data, device=xshard.device())``, which copies the host data into an empty
    device tensor.
    """
    return transfer.copy_(dst, src)


def local_scalar_dense(t):
    """Kernel of ``aten::_local_scalar_dense`` for the xshard device (the Python key excluded:
    ``torch.as_tensor([t0, t1])`` reads each 0-d tensor)."""
    return transfer.item(t)


def _to_copy(func, args, kwargs):
    out = transfer.to_copy(args[0], kwargs)
    if isinstance(out, torch.Tensor):
        return out
    value, stride, annotation = out
    return new_base(value, stride, sharding=annotation)


def _restride_(func, args, kwargs):
    """In-place view ops (``squeeze_``, ``t_``, ``as_strided_``...) change the tensor's own shape.

    The tensor becomes the view its functional twin makes (same cell, one more view step), and its
    sizes and strides are set to the view's, as the CPU kernel does.
    """
    twin = ops.facts(func).functional
    view = getattr(twin, func._overloadname, None) or twin
    return _become(args[0], view(*args, **kwargs))


def _become(self, out):
    """``self`` made the tensor ``out`` is (its cell, view chain, sizes, strides and offset), in
    place: the Python object stays, as in-place ops keep it."""
    shape, stride, offset = out.shape, out.stride(), out.storage_offset()
    if _span(shape, stride, offset) * out.element_size() <= self.untyped_storage().nbytes():
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY):
            aten.as_strided_.default(self, shape, stride, offset)
    else:
        # More elements than the (data-less) storage of the wrapper was made for, which PyTorch
        # checks sizes against: it takes ``out``'s storage and metadata, as ``t.data = out``.
        _TENSOR_DATA.__set__(self, out)
    self._cell, self._chain, self._cache_version = out._cell, out._chain, -1
    self._meta = (tuple(self.shape), tuple(self.stride()), self.dtype)
    return self


_PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)


def _span(shape, stride, offset) -> int:
    """How many elements of storage a tensor of these sizes, strides and offset reaches."""
    if math.prod(shape) == 0:
        return 0
    return 1 + offset + sum((n - 1) * s for n, s in zip(shape, stride))


class _Holder:
    __slots__ = ("cell",)


_ALONE = _Holder()  # an object one attribute refers to: the count of a cell only self holds
_ALONE.cell = object()


def _references(obj) -> int:
    return sys.getrefcount(obj)


def _resize_(func, args, kwargs):
    """``resize_``: the tensor becomes a contiguous (or ``memory_format``) view of its storage
    from its storage offset; a storage too small for it grows, its first elements kept and the
    rest zeros (eager leaves them uninitialized)."""
    self, size = args[0], tuple(args[1])
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if tuple(self.shape) == size and memory_format is None:
        return self
    stride = torch.empty(size, device="meta", memory_format=memory_format or
                         torch.contiguous_format).stride()
    offset = self.storage_offset()
    span = _span(size, stride, offset)
    held = math.prod(self._cell.value.shape)
    if span <= held:
        return _become(self, aten.as_strided.default(self, size, stride, offset))
    if _references(self._cell) > _references(_ALONE.cell):  # tensors besides ``self`` hold it
        raise RuntimeError(
            f"resize_ to {list(size)} needs {span} elements of storage and this tensor's holds "
            f"{held}, which other tensors (views of it, or tensors it views) share: xshard "
            f"cannot grow storage in place for them all. Resize a tensor that shares no storage "
            f"(t = t.clone() first), or make a new one (t.new_empty({list(size)})).")
    whole = aten.as_strided.default(self, (held,), (1,), 0)  # the storage, in memory order
    grown = torch.cat([whole, whole.new_zeros(span - held)])
    return _become(self, aten.as_strided.default(grown, size, stride, offset))


def _resize_as_(func, args, kwargs):
    self, template = args[0], args[1]
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if memory_format is torch.preserve_format:
        memory_format = suggest_memory_format(template)
    return _resize_(func, (self, template.shape, memory_format), {})


def _set_(func, args, kwargs):
    """``set_``: the tensor shares the storage of another xshard tensor (with the other's sizes
    and strides, or those given), or a new empty one."""
    self = args[0]
    if func is aten.set_.default:
        return _become(self, self.new_empty((0,)))
    source = args[1]
    if isinstance(source, torch.UntypedStorage) and \
            source._cdata == self.untyped_storage()._cdata:
        # Its own storage: ``t.set_(t.untyped_storage())`` makes t all of it, 1-D.
        if func is aten.set_.source_Storage:
            return _become(self, aten.as_strided.default(
                self, (math.prod(self._cell.value.shape),), (1,), 0))
        source = self
    if not isinstance(source, XTensor):
        # ``t.set_(other, offset, size, stride)`` reaches here with other's storage object too.
        raise TypeError(
            f"set_ of an xshard tensor to a {type(source).__name__}: xshard cannot tell whose "
            f"data a storage object holds (set_(other, offset, size, stride) passes other's). "
            f"Pass an xshard tensor: t.set_(other), or "
            f"t.set_(other.as_strided(size, stride, offset)).")
    if source.dtype != self.dtype:
        raise RuntimeError(f"set_: expected a source of dtype {self.dtype}, got {source.dtype} "
                           f"(convert it first: source.to({self.dtype}))")
    if func is aten.set_.source_Tensor:
        return self if source is self else _become(self, _alias(None, (source,), {}))
    offset, size = args[2], tuple(args[3])
    stride = tuple(args[4]) if len(args) > 4 and args[4] else contiguous_strides(size)
    return _become(self, aten.as_strided.default(source, size, stride, offset))


def factory(func, args, kwargs):
    """Kernel for factory ops called with ``device=xshard``: a node, no data transfer."""
    if trace.OPEN is None:  # as in dispatch()
        trace.recording_op()
    node, stride = record.factory(func, args, kwargs)
    return new_base(node, stride)


_SPECIAL = {id(op): handler for op, handler in {
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten._local_scalar_dense.default: lambda f, a, k: transfer.item(a[0]),
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.lift_fresh.default: _alias,
    aten._has_compatible_shallow_copy_type.default: lambda f, a, k: True,
    aten.is_pinned.default: lambda f, a, k: False,
    aten.record_stream.default: lambda f, a, k: None,
    aten.squeeze_.default: _restride_, aten.squeeze_.dim: _restride_,
    aten.squeeze_.dims: _restride_, aten.unsqueeze_.default: _restride_,
    aten.transpose_.default: _restride_, aten.t_.default: _restride_,
    aten.swapdims_.default: _restride_, aten.swapaxes_.default: _restride_,
    aten.as_strided_.default: _restride_,
    aten.resize_.default: _resize_, aten.resize_as_.default: _resize_as_,
    aten.set_.default: _set_, aten.set_.source_Tensor: _set_,
    aten.set_.source_Tensor_storage_offset: _set_,
    aten.set_.source_Storage: _set_, aten.set_.source_Storage_storage_offset: _set_,
}.items()}  # aten overloads live as long as torch: their ids stay their own
