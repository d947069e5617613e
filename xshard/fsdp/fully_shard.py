"""FSDP on sharding annotations: parameters, gradients and optimizer state split over the ``fsdp`` axis.

[Note: FSDP as annotations]
Every parameter is stored sharded over the mesh axis ``fsdp`` (on its largest dimension by default),
so parameter, gradient and optimizer-state memory per device is 1/N of the model. A *unit* (a module
chosen by the auto-wrap policy; the root is always one) gathers its parameters when it runs:

- pre-forward: the unit's sharded parameters and its inputs pass one optimisation barrier, then each
  parameter is constrained to be replicated: XLA's partitioner emits an all-gather there, and the
  barrier keeps it from hoisting every unit's gather to the start of the program;
- the gathered values replace the parameters inside the unit's modules for the forward, and the
  parameters are put back after it;
- with ``reshard_after_forward`` the gathered values are not saved for backward (saved-tensor hooks
  swap them for the sharded parameter), and the unit gathers again in its pre-backward hook, behind a
  barrier with the incoming gradient, so a peak holds about one unit's full parameters;
- the gradient of a gathered value is constrained back to the parameter's sharding: XLA emits a
  reduce-scatter, and the gradient lives sharded like the parameter (and so does the optimizer
  state, which torch.optim creates with ``zeros_like``);
- under ``no_sync`` the gradient is kept as per-device partial sums instead, reduced once by the
  first backward outside it (see [Note: no_sync as per-device rows]).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import json
import math
import warnings

import torch
import torch.nn as nn

from xshard.core import api as core
from xshard.core import distributed, divergence, ir, runtime
from xshard.core.backend import DEVICE
from xshard.core.barrier import optimization_barrier, ordered_after
from xshard.core.record import convert
from xshard.core.tensor import XTensor
from xshard.fsdp import partial
from xshard.fsdp.state_dict import full_state_dict, sharded_state_dict, to_full
from xshard.fsdp.mixed_precision import MixedPrecision
from xshard.fsdp.wrap import select_units
from xshard.mesh import Mesh, get_1d_mesh, get_global_mesh
from xshard.spmd import api as spmd_api
from xshard.spmd import sharding as sh

FSDP_AXIS = "fsdp"

# Units register a full backward pre-hook only to learn when their backward starts; PyTorch warns
# when such a module's inputs need no gradient (an embedding's token ids), which is fine here.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are "
                        "computed with respect to module outputs since no inputs require")


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


@functools.cache
def _fsdp_class(module_cls: type) -> type:
    return type(f"FSDP{module_cls.__name__}", (FSDP, module_cls), {})


class FSDP:
    """Fully sharded data parallel over a mesh axis named ``fsdp``.

    ``FSDP(module, ...)`` shards ``module`` in place and returns it (its class gains the FSDP
    methods; parameter names and ``state_dict`` keys stay those of the original module).

    Args:
        module: the model (on CPU or already on the xshard device).
        mesh: the mesh; default the global mesh, else a 1-D mesh over all devices named ``fsdp``.
        auto_wrap_policy: which submodules become units, e.g.
            ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
        reshard_after_forward: free gathered parameters after each unit's forward and gather again
            for its backward.
        mixed_precision: a ``MixedPrecision`` (e.g. bf16 compute with fp32 master weights).
        shard_output: callable ``(output, mesh)`` applied to the root output, or None to shard a
            tensor output's batch dimension over the data axes (scalars are left alone).
        extra_data_axis: a mesh axis over which the model is replicated and the batch split.
        shard_param_on_dim_0: shard every parameter on dimension 0 instead of its largest one.
        shard_input: shard the root's tensor inputs' batch dimension over the data axes.
        sync_module_states: in a multi-process run, start every process from process 0's
            parameters and buffers (one broadcast). Without it, the processes' initial values
            are compared, and differing ones raise ``ParametersDifferError``.
        optimization_barrier_in_forward, optimization_barrier_in_backward: gather each unit's
            parameters only when the unit runs (its inputs, or its incoming gradient, exist),
            so about one unit is gathered at a time (torch_xla's options of the same names).
            False lets XLA schedule the gathers freely, as a JAX program sharded the same way
            is: faster when every gathered parameter fits in memory at once (see [Note: FSDP
            without barriers]).
        reduce_scatter_bucket_size_mb: a unit's gradients are reduced to their shards together,
            one reduce-scatter per bucket of at most this many megabytes (per device, before
            the reduction); 0 reduces each gradient alone (torch_xla's option and meaning; its
            default is 0). Larger buckets mean fewer collectives and one bucket of extra
            temporary memory (see [Note: FSDP gradient buckets]).

    Example:
        >>> model = FSDP(GPT(cfg), auto_wrap_policy=partial(transformer_auto_wrap_policy,
        ...                                                  transformer_layer_cls={Block}))
    """

    def __new__(cls, module: nn.Module | None = None, *args, **kwargs):
        if module is None and not args and not kwargs and cls is not FSDP:
            # copy.deepcopy / copy.copy of a wrapped module (AveragedModel's EMA copy): its class
            # makes an empty instance, then takes the copied state (units, hooks, shardings).
            return super().__new__(cls)
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}.")
        if isinstance(module, FSDP):
            raise RuntimeError("This module is already wrapped with FSDP; wrap it once.")
        module.__class__ = _fsdp_class(type(module))
        return module

    def __init__(self, module: nn.Module, *, mesh: Mesh | None = None, auto_wrap_policy=None,
                 reshard_after_forward: bool = True, mixed_precision: MixedPrecision | None = None,
                 shard_output=None, extra_data_axis: str | None = None,
                 shard_param_on_dim_0: bool = False, shard_input: bool = True,
                 sync_module_states: bool = False, optimization_barrier_in_forward: bool = True,
                 optimization_barrier_in_backward: bool = True,
                 reduce_scatter_bucket_size_mb: float = 25):
        try:
            mesh = _resolve_mesh(mesh)
            _check_options(mesh, extra_data_axis, mixed_precision, shard_output,
                           reshard_after_forward=reshard_after_forward,
                           shard_param_on_dim_0=shard_param_on_dim_0, shard_input=shard_input,
                           sync_module_states=sync_module_states,
                           optimization_barrier_in_forward=optimization_barrier_in_forward,
                           optimization_barrier_in_backward=optimization_barrier_in_backward)
            _check_bucket_size(reduce_scatter_bucket_size_mb)
            units = select_units(self, auto_wrap_policy)
        except BaseException:
            self.__class__ = type(self).__bases__[1]  # bad arguments leave the module as given
            raise
        self._fsdp_mesh = mesh
        self._fsdp_data_axes = (FSDP_AXIS,) if extra_data_axis is None else (
            extra_data_axis, FSDP_AXIS)
        self._fsdp_mp = mixed_precision
        self._fsdp_data_entry = None  # the data axes as a sharding spec entry (see _shard_dim)
        self._fsdp_bucket_bytes = int(reduce_scatter_bucket_size_mb * 2 ** 20)
        self._fsdp_reshard = reshard_after_forward
        self._fsdp_fenced = {"forward": optimization_barrier_in_forward,
                             "backward": optimization_barrier_in_backward}
        self._fsdp_shard_output = shard_output
        self._fsdp_shard_input = shard_input
        self._fsdp_sync_grads = True
        # The backward pass (see _backward_id) for which each end-of-backward callback is queued,
        # or None. Keyed by pass, not a flag: a backward that raises never runs its callbacks.
        self._fsdp_release_queued = None
        self._fsdp_grads_queued = None
        self._fsdp_batch = None  # (backward pass, BatchDims)
        self._fsdp_rows_shardings: dict = {}
        self._fsdp_order_by_data = False
        # (caller's tensor, the copy the forward gets, its write count): see _write_back_inputs
        self._fsdp_replaced_inputs: list = []
        _agree_initial_values(self, sync_module_states)
        self._fsdp_on_dim_0 = shard_param_on_dim_0
        # The dtypes buffers had before MixedPrecision.buffer_dtype cast them, by name: a full
        # state dict holds them in these (as PyTorch's FSDP).
        self._fsdp_buffer_dtypes = {} if mixed_precision is None or \
            mixed_precision.buffer_dtype is None else {
                name: b.dtype for name, b in self.named_buffers()
                if b.is_floating_point() and b.dtype != mixed_precision.buffer_dtype}
        _shard_parameters(self, mesh, shard_param_on_dim_0, mixed_precision)
        owned: set = set()
        self._fsdp_units = []
        for module_ in units:
            params = [p for p in module_.parameters() if id(p) not in owned]
            owned.update(id(p) for p in params)
            self._fsdp_units.append(_Unit(self, module_, params))
        self.register_forward_pre_hook(_root_pre_forward, with_kwargs=True, prepend=True)
        self.register_forward_hook(_root_post_forward)

    # -- information ---------------------------------------------------------------------------

    @property
    def fsdp_units(self) -> list[nn.Module]:
        """The modules that are units, innermost first (the root last)."""
        return [u.module for u in self._fsdp_units]

    @property
    def mesh(self) -> Mesh:
        return self._fsdp_mesh

    # -- gradients ------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the (sharded) gradients by their global norm; returns the norm before clipping."""
        params = [p for p in self.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without a collective per micro-step.

        Inside it, each device keeps its own block of the batch's contribution to every gradient
        (the gradient's full shape per device, as PyTorch FSDP's ``no_sync`` keeps); the first
        backward outside it adds its own contribution and reduces the total to the parameter's
        sharding once. Reading a gradient meanwhile (the optimizer, ``clip_grad_norm_``,
        ``.cpu()``) reads the reduced sum. See [Note: no_sync as per-device rows].

        Example:
            >>> with model.no_sync():
            ...     for x, y in micro_batches[:-1]:
            ...         model(x, y).backward(); xshard.sync()
            >>> model(*micro_batches[-1]).backward()   # reduces once
        """
        previous = self._fsdp_sync_grads
        self._fsdp_sync_grads = False
        try:
            yield
        finally:
            self._fsdp_sync_grads = previous

    @property
    def module(self) -> nn.Module:
        """The wrapped module: this module itself (FSDP wraps in place), as PyTorch's and
        torch_xla's FSDP ``.module``; a submodule the model registered as ``module`` wins."""
        return self._modules.get("module", self)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self, *args, rank0_only: bool = False, **kwargs):
        """Full tensors on CPU under the original names (use ``sharded_state_dict`` for shards).

        In a multi-process run this gathers every sharded tensor: a collective, so every process
        must call it.

        Args:
            rank0_only: only process 0 keeps the host copies; the others return ``{}`` (they
                still take part in the gathers).

        Example:
            >>> state = model.state_dict(rank0_only=True)     # on every process
            >>> if xshard.is_main_process():
            ...     torch.save(state, "model.pt")
        """
        state = full_state_dict(self, super().state_dict(*args, **kwargs), rank0_only=rank0_only)
        prefix = kwargs.get("prefix", "")
        for name, dtype in self._fsdp_buffer_dtypes.items():
            if prefix + name in state:
                state[prefix + name] = state[prefix + name].to(dtype)
        return state

    def sharded_state_dict(self) -> dict:
        """Each parameter/buffer as this process's local shards (CPU) plus what is needed to
        reassemble it; no communication. In a multi-process run the entries are incomplete (the
        other blocks live on other processes): ``to_full`` refuses them."""
        return sharded_state_dict(self, nn.Module.state_dict(self))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full or a sharded state dict, saved on any number of devices.

        The values are copied into FSDP's sharded parameters and buffers, which keep their
        placement; so ``assign=True`` (take the state dict's tensors themselves) gives the same
        module, and is refused where an entry's dtype differs from the module's (the one thing
        it would change).
        """
        state_dict = to_full(state_dict)
        if assign:
            own = dict(itertools.chain(self.named_parameters(remove_duplicate=False),
                                       self.named_buffers(remove_duplicate=False)))
            for key, value in state_dict.items():
                mine = own.get(key)
                if isinstance(value, torch.Tensor) and mine is not None and value.dtype not in (
                        mine.dtype, self._fsdp_buffer_dtypes.get(key)):
                    raise ValueError(
                        f"FSDP.load_state_dict(assign=True): {key!r} is {value.dtype} in the "
                        f"state dict and {mine.dtype} in the module. FSDP copies values into its "
                        f"sharded parameters, so it cannot take the state dict's dtype: cast the "
                        f"state dict (or the model before wrapping it), or pass assign=False to "
                        f"convert on copy.")
        return super().load_state_dict(state_dict, strict=strict)


def _resolve_mesh(mesh: Mesh | None) -> Mesh:
    if mesh is None:
        mesh = get_global_mesh()
    if mesh is None:
        mesh = get_1d_mesh(FSDP_AXIS)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an xshard Mesh, got {type(mesh).__name__}.")
    if mesh.axis_names is None or FSDP_AXIS not in mesh.axis_names:
        raise ValueError(
            f"The mesh must have an axis named 'fsdp'; its axes are {mesh.axis_names}. Build it "
            f"with axis_names including 'fsdp', e.g. Mesh(ids, (8,), ('fsdp',)).")
    return mesh


def _check_options(mesh: Mesh, extra_data_axis, mixed_precision, shard_output, **flags) -> None:
    if extra_data_axis is not None and (mesh.axis_names is None
                                        or extra_data_axis not in mesh.axis_names):
        raise ValueError(
            f"extra_data_axis={extra_data_axis!r} is not an axis of the mesh; its axes are "
            f"{mesh.axis_names}. Pass one of them, or None for no extra data axis.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be an xshard.fsdp.MixedPrecision, got "
                        f"{mixed_precision!r}.")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}.")
    if shard_output is not None and not callable(shard_output):
        raise TypeError(
            f"shard_output must be a callable (output, mesh) -> output, or None to shard a "
            f"tensor output's batch dimension over the data axes; got {shard_output!r}.")


def _check_bucket_size(size) -> None:
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0 or \
            size == float("inf"):
        raise ValueError(
            f"reduce_scatter_bucket_size_mb must be a finite number >= 0 (megabytes of gradients "
            f"reduced together), got {size!r}. Pass 0 to reduce each gradient alone.")


def param_annotation(p: torch.Tensor, mesh: Mesh, on_dim_0: bool) -> sh.Annotation:
    """Sharded over ``fsdp`` on the largest dimension (or dim 0); scalars replicated."""
    spec = [None] * p.dim()
    if p.dim():
        dim = 0 if on_dim_0 else max(range(p.dim()), key=lambda d: (p.shape[d], -d))
        spec[dim] = FSDP_AXIS
    return sh.annotation(mesh, tuple(spec), p.dim())


class ParametersDifferError(divergence.MultiProcessDivergenceError):
    """FSDP's initial parameters differ across the processes of a multi-process run."""


def _host_states(root: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's CPU parameters and buffers (each once), by name."""
    seen, out = set(), []
    for name, t in itertools.chain(root.named_parameters(), root.named_buffers()):
        if isinstance(t, XTensor) or t.device.type != "cpu" or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _agree_initial_values(root: nn.Module, broadcast: bool) -> None:
    """Multi-process: process 0's initial values everywhere (``broadcast``), or a check that the
    processes' values are equal already (each uploads only its own shards, so nothing else
    would notice)."""
    if not distributed.ACTIVE:
        return
    states = _host_states(root)
    if broadcast:
        _broadcast_from_process_0([t for _, t in states])
        return
    from xshard.core.dtypes import torch_to_numpy

    digests = [divergence.sample_digest(torch_to_numpy(t.detach())) for _, t in states]
    everyone = [json.loads(p) for p in
                divergence.exchange("FSDP initial parameters", json.dumps(digests))]
    if any(len(d) != len(digests) for d in everyone):
        counts = ", ".join(f"process {p}: {len(d)}" for p, d in enumerate(everyone))
        raise ParametersDifferError(
            f"FSDP: the processes wrap modules with different numbers of parameters and buffers "
            f"({counts}); every process must build the same model.")
    differ = [name for i, (name, _) in enumerate(states) if len({d[i] for d in everyone}) > 1]
    if differ:
        shown = ", ".join(repr(n) for n in differ[:5]) + (", ..." if len(differ) > 5 else "")
        raise ParametersDifferError(
            f"FSDP: {len(differ)} of {len(states)} parameters and buffers differ across the "
            f"{len(everyone)} processes ({shown}). Every process must start from the same values: "
            f"call torch.manual_seed(s) with the same s on every process before building the "
            f"model, or pass FSDP(..., sync_module_states=True) to copy process 0's values to "
            f"the others.")


def _broadcast_from_process_0(tensors: list[torch.Tensor]) -> None:
    """Overwrites ``tensors`` with process 0's values: their bytes in one buffer, one broadcast
    (torch.distributed's gloo group; JAX's broadcast_one_to_all without one)."""
    if not tensors:
        return
    with torch.no_grad():
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        buffer = torch.cat(flat)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.broadcast(buffer, src=0)
        else:
            from jax.experimental import multihost_utils

            buffer = torch.from_numpy(multihost_utils.broadcast_one_to_all(buffer.numpy()).copy())
        offset = 0
        for t, f in zip(tensors, flat):
            t.copy_(buffer[offset:offset + f.numel()].view(t.dtype).reshape(t.shape))
            offset += f.numel()


def _shard_parameters(root: nn.Module, mesh: Mesh, on_dim_0: bool, mp: MixedPrecision | None):
    """Moves the module to the device with every parameter written straight into its shards."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False):
            if isinstance(t, XTensor):
                if core.annotation(t) is None:
                    spmd_api.mark_sharding(t, mesh, _spec(param_annotation(t, mesh, on_dim_0)))
                return t
            annotation = param_annotation(t, mesh, on_dim_0)
            source = t.detach() if t.device.type == "meta" else t.detach().cpu()
            return core.new_tensor(core.upload_annotated(source, annotation), annotation)
        out = t.to(DEVICE)
        if mp is not None and mp.buffer_dtype is not None and out.is_floating_point():
            out = out.to(mp.buffer_dtype)
        return out

    with torch.no_grad():
        root._apply(move)
    # Gradients that reach a parameter outside its unit's gather (a tied weight read by a module of
    # another unit) still end up sharded like the parameter.
    for p in root.parameters():
        spmd_api.grads_like_param(p)


def _spec(annotation: sh.Annotation) -> tuple:
    names = annotation.mesh.axis_names
    return tuple(None if e is None else tuple(names[a] for a in e) for e in annotation.spec)


# -- units ---------------------------------------------------------------------------------------


class _Unit:
    """One FSDP unit: a module and the parameters it gathers, with its lifecycle hooks."""

    def __init__(self, root: FSDP, module: nn.Module, params: list[nn.Parameter]):
        self.root = root
        self.module = module
        self.params = params
        ids = {id(p): i for i, p in enumerate(params)}
        # Every (submodule, name) slot holding one of the params, tied parameters included.
        self.slots = [(m, name, ids[id(p)]) for m in module.modules()
                      for name, p in m._parameters.items() if p is not None and id(p) in ids]
        self.state = TrainingState.IDLE
        self.gathered_cells: dict = {}
        self.backward_gathered: list | None = None
        self.replicated = [sh.annotation(root._fsdp_mesh, (None,) * p.dim(), p.dim())
                           for p in params]
        if params:
            module._xshard_fsdp_unit = self  # activation checkpointing recomputes through it
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True)
            # always_call: a forward that raises still puts the parameters back and removes the
            # saved-tensor hooks (else every later autograd op in the process would run them).
            module.register_forward_hook(self.post_forward, always_call=True)
            if module is not root:
                # The root's inputs rarely need gradients (token ids), which full backward hooks
                # warn about; the root gathers lazily when backward first unpacks a parameter.
                module.register_full_backward_pre_hook(self.pre_backward)
        self._hooks = None

    # forward

    def pre_forward(self, module, args, kwargs):
        if not self.params:
            return None
        self.state = TrainingState.FORWARD
        self.gather(args, kwargs)
        self.gathered_cells = {core.storage(m._parameters[name]): i for m, name, i in self.slots}
        self.backward_gathered = None
        if self.root._fsdp_reshard and torch.is_grad_enabled():
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._hooks.__enter__()
        return None

    def gather(self, args, kwargs) -> None:
        """Puts the gathered parameters in the unit's modules, gathered once the unit's input
        tensors exist. The inputs stay the caller's tensors (a unit may write into one in place,
        a KV-cache slot: the write was made into a fenced copy, lost under no_grad)."""
        inputs, _ = _tensors_of((args, kwargs))
        gathered = _GatherForward.apply(self, inputs, *self.params)
        for m, name, i in self.slots:
            m._parameters[name] = gathered[i]

    def recompute(self, forward, args, kwargs):
        """``forward`` run again by activation checkpointing in backward: the parameters are
        gathered afresh (after the recomputation's inputs, so they are alive for this unit's
        backward only) and its gradients take the unit's path (reduced, or kept under no_sync)."""
        self.gather(args, kwargs)
        try:
            return forward(*args, **kwargs)
        finally:
            for m, name, i in self.slots:
                m._parameters[name] = self.params[i]

    def post_forward(self, module, args, output):
        """After the unit's forward, also one that raised (then ``output`` is None)."""
        if not self.params:
            return None
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        for m, name, i in self.slots:
            m._parameters[name] = self.params[i]
        # Holding the gathered tensors would make them outputs of the next sync (full copies).
        self.gathered_cells = {}
        self.state = TrainingState.IDLE
        return None

    # backward

    def pack(self, t):
        if isinstance(t, XTensor):
            index = self.gathered_cells.get(core.storage(t))
            if index is not None:
                return _Regather(index, core.view_spec(t))
        return t

    def unpack(self, saved):
        if not isinstance(saved, _Regather):
            return saved
        if self.backward_gathered is None:
            self.gather_for_backward(())
        return core.view_of(self.backward_gathered[saved.index], saved.view)

    def pre_backward(self, module, grad_output):
        self.state = TrainingState.PRE_BACKWARD
        if self.root._fsdp_reshard:
            grads = [g for g in grad_output if isinstance(g, XTensor)]
            self.gather_for_backward(grads)
        return None

    def gather_for_backward(self, grads):
        if self.root._fsdp_release_queued != _backward_id():
            self.root._fsdp_release_queued = _backward_id()
            torch.autograd.Variable._execution_engine.queue_callback(self.root_release)
        with torch.no_grad():
            fenced = self.fence([p.detach() for p in self.params], list(grads), "backward")
            self.backward_gathered = [
                _gathered_tensor(fenced[i], self.replicated[i], self.root._fsdp_mp)
                for i in range(len(self.params))]

    def fence(self, params: list, others: list, phase: str) -> list:
        """``params + others`` behind one barrier, ``params`` gathered only once ``others`` exist
        (see [Note: FSDP gathers ordered by data]); as they are when the barriers of ``phase``
        (forward or backward) are off."""
        if not self.root._fsdp_fenced[phase]:
            return params + others
        if self.root._fsdp_order_by_data:
            params = ordered_after(params, others)
            return optimization_barrier(params + others, program_order=False)
        return optimization_barrier(params + others)

    def root_release(self):
        """End of backward: drop every unit's gathered parameters (see post_forward)."""
        for unit in self.root._fsdp_units:
            unit.backward_gathered = None
            unit.state = TrainingState.IDLE
        self.root._fsdp_release_queued = None


class _Regather:
    """What a unit saves for backward instead of a gathered parameter (see [Note: FSDP as
    annotations])."""

    __slots__ = ("index", "view")

    def __init__(self, index, view):
        self.index, self.view = index, view


def _gathered_tensor(sharded: XTensor, replicated: sh.Annotation, mp) -> XTensor:
    value = core.value(sharded)
    if mp is not None and mp.param_dtype is not None and value.dtype != mp.param_dtype:
        value = convert(value, mp.param_dtype)
    return core.new_tensor(core.constrain(value, replicated))


class _GatherForward(torch.autograd.Function):
    """Barrier(params, inputs) -> all-gather each param; backward reduce-scatters the gradients.
    The inputs (a list, not autograd inputs) only order the gathers after them."""

    @staticmethod
    def forward(ctx, unit: _Unit, inputs: list, *params):
        n_params = len(params)
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # unused parameters keep grad None, as in eager
        ctx.n_params = n_params
        ctx.param_dtypes = [p.dtype for p in params]
        frozen = [not p.requires_grad for p in params]
        tensors = [t.detach() for t in (*params, *inputs)]
        fenced = unit.fence(tensors[:n_params], tensors[n_params:], "forward") if all(
            isinstance(t, XTensor) for t in tensors) else tensors
        gathered = [_gathered_tensor(fenced[i], unit.replicated[i], unit.root._fsdp_mp)
                    for i in range(n_params)]
        # A frozen parameter stays one after the gather, as in eager: no gradient is computed
        # for it, and a checkpointed module's recomputation, which reads the parameter itself,
        # saves the same tensors as its forward did.
        ctx.mark_non_differentiable(*(g for g, f in zip(gathered, frozen) if f))
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        root = unit.root
        mp = root._fsdp_mp
        out = [None] * ctx.n_params
        combined = []  # (i, split dimension, per-device rows): reduced together
        for i, g in enumerate(grads[:ctx.n_params]):
            if g is None:
                continue
            if mp is not None and mp.reduce_dtype is not None:
                g = g.to(mp.reduce_dtype)
            param = unit.params[i]
            if not root._fsdp_sync_grads:
                _accumulate_rows(root, param, g)
                continue  # the gradient is in param.grad already, as per-device rows
            d = _shard_dim(root, param)
            held = _rows_of(param.grad)
            if held is not None:  # sum what no_sync accumulated with this step's, in one reduction
                param.grad = None
                rows = held + _grad_rows(root, g, held.dtype)
            else:
                rows = None if d is None else _split_rows(root, g)
            if rows is not None and d is not None:
                combined.append((i, d, rows))
                continue
            if rows is not None:
                g = _partial_grad(root, rows)
            out[i] = spmd_api.constrained(g, core.annotation(param)).to(ctx.param_dtypes[i])
        if combined:
            _reduce_together(root, unit, combined, out, ctx.param_dtypes)
        if root._fsdp_sync_grads and root._fsdp_grads_queued != _backward_id():
            root._fsdp_grads_queued = _backward_id()
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_annotate_grads, root))
        return (None, None, *out)


def _shard_dim(root, param) -> int | None:
    """The dimension of ``param`` split evenly over exactly the data axes, the rest whole; else
    None."""
    a = core.annotation(param)
    if a is None or a.mesh is not root._fsdp_mesh:
        return None
    dims = [d for d, e in enumerate(a.spec) if e is not None]
    if len(dims) != 1:
        return None
    if root._fsdp_data_entry is None:
        root._fsdp_data_entry = sh.annotation(root._fsdp_mesh, (root._fsdp_data_axes,), 1).spec[0]
    if a.spec[dims[0]] != root._fsdp_data_entry:
        return None
    d = dims[0]
    return d if param.shape[d] % _batch_dims(root).n == 0 else None


def _split_rows(root, g):
    value = partial.split_rows(core.value(g), _batch_dims(root), _rows_sharding(root, g.dim()))
    return None if value is None else core.new_tensor(value)


# [Note: FSDP gradient buckets]
# A parameter's gradient is a sum over the batch, which is split over the data axes. Left to the
# partitioner, each gradient is all-reduced where it is computed and then sliced to the parameter's
# shard: one collective per parameter, and a full-size result per device. Here a unit's gradients
# are first rewritten into per-device rows (see [Note: per-device partial sums] in
# xshard.fsdp.partial; no communication), each laid out as ``(devices, devices, shard)``: row r,
# block b is device r's addend of the shard device b keeps. Gradients are concatenated along the
# shard dimension into buckets of at most ``reduce_scatter_bucket_size_mb`` (per device, before the
# reduction), and each bucket is reduced by one reduce-scatter (``ir.SCATTERED_SUM``), whose block
# b lands on device b: every gradient's shard is already where its parameter's sharding puts it, so
# slicing it out moves no data. Bucket size 0 gives one reduce-scatter per gradient.
#
# This is how PyTorch's FSDP reduces (a unit's flat gradient, one reduce-scatter), and torch_xla's
# option of the same name buckets so. Measured on the small GPT+AdamW step (2 blocks, d 128,
# 8 virtual CPU devices, compiled, in one process): 31 all-reduces become 3 reduce-scatters, and the
# step goes from 1.14x to 1.07x a JAX program's (CPU time: 1.10x to 1.05x); per-gradient
# reduce-scatters alone measured as the all-reduces. On the CPU backend, with FSDP's barriers, XLA
# does not combine collectives itself (see [Note: barriers on the CPU backend]). The price is
# memory: a bucket's unreduced gradients and their concatenation are alive together, one bucket
# more than reducing each gradient alone (tests/fsdp/test_memory.py). Gradients that are not split
# evenly on one dimension over exactly the data axes (uneven sizes, hybrid sharding's parameters,
# tensor-parallel ones), or whose computation cannot be split per device, are reduced alone, by
# the partitioner, as before.
def _reduce_together(root, unit, combined, out, dtypes):
    """The gradients ``combined`` holds as ``(param index, split dimension, per-device rows)``,
    reduced to their parameters' shards in buckets (see [Note: FSDP gradient buckets])."""
    n = _batch_dims(root).n
    for bucket in _buckets(combined, root._fsdp_bucket_bytes):
        blocks = [rows.movedim(d + 1, 1).reshape(n, n, -1) for _, d, rows in bucket]
        flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
        total = core.new_tensor(ir.scattered_sum(core.value(flat), _rows_sharding(root, 2)))
        start = 0
        for (i, d, rows), block in zip(bucket, blocks):
            size = block.shape[2]
            shape = rows.shape[1:]
            moved = (shape[d], *shape[:d], *shape[d + 1:])  # the split dimension first
            g = total[:, start:start + size].reshape(moved).movedim(0, d)
            start += size
            out[i] = spmd_api.constrained(g, core.annotation(unit.params[i])).to(dtypes[i])


def _buckets(combined, cap: int) -> list:
    """``combined`` in runs of one dtype of at most ``cap`` bytes (per device, before the
    reduction; a larger gradient alone)."""
    buckets, open_ = [], {}
    for entry in combined:
        rows = entry[2]
        size = math.prod(rows.shape[1:]) * rows.element_size()
        bucket = open_.get(rows.dtype)
        if bucket is None or bucket[0] + size > cap:
            bucket = open_[rows.dtype] = [0, []]
            buckets.append(bucket[1])
        bucket[0] += size
        bucket[1].append(entry)
    return buckets


# [Note: no_sync as per-device rows]
# Under no_sync a parameter's gradient is not reduced: each device keeps the part of it that its own
# block of the batch contributes (see xshard.fsdp.partial), and param.grad holds the rows as a
# partial sum (one full-size gradient per device, as PyTorch FSDP's no_sync keeps). Later micro-steps
# add their rows in place; the first backward outside no_sync adds its own rows and reduces the
# total once, to the parameter's sharding. Anything else that reads the gradient meanwhile (the
# optimizer, clip_grad_norm_, .cpu()) reads the reduced sum, so nothing is lost either way.
def _rows_sharding(root: FSDP, ndim: int):
    """One row per device: the leading dimension split over the data axes."""
    sharding = root._fsdp_rows_shardings.get(ndim)
    if sharding is None:
        spec = (root._fsdp_data_axes,) + (None,) * ndim
        sharding = sh.annotation(root._fsdp_mesh, spec, ndim + 1).jax_sharding
        root._fsdp_rows_shardings[ndim] = sharding
    return sharding


def _batch_dims(root: FSDP) -> partial.BatchDims:
    """Where the batch is in this backward's values (dropped when the backward ends)."""
    if root._fsdp_batch is None or root._fsdp_batch[0] != _backward_id():
        axes = root._fsdp_data_axes
        batch = partial.BatchDims(axes, partial.device_count(root._fsdp_mesh, axes))
        root._fsdp_batch = (_backward_id(), batch)

        def drop():
            root._fsdp_batch = None

        torch.autograd.Variable._execution_engine.queue_callback(drop)
    return root._fsdp_batch[1]


def _backward_id() -> int:
    """Autograd's id of the backward pass running now (its graph task; -1 outside one)."""
    return torch._C._current_graph_task_id()


def _grad_rows(root: FSDP, g: XTensor, dtype: torch.dtype) -> XTensor:
    rows = partial.per_device_rows(core.value(g), _batch_dims(root),
                                   _rows_sharding(root, g.dim()))
    rows = core.new_tensor(rows)
    return rows if rows.dtype == dtype else rows.to(dtype)


def _partial_grad(root: FSDP, rows: XTensor) -> XTensor:
    sharding = _rows_sharding(root, rows.dim() - 1)
    return core.new_tensor(ir.partial_sum(core.value(rows), sharding))


def _rows_of(grad) -> XTensor | None:
    """The per-device rows of a gradient accumulated under no_sync, or None."""
    if not isinstance(grad, XTensor) or core.is_view(grad):
        return None
    value = core.value(grad)
    return core.new_tensor(value.inputs[0]) if value.op is ir.PARTIAL_SUM else None


def _accumulate_rows(root: FSDP, param: nn.Parameter, g: XTensor) -> None:
    with torch.no_grad():
        rows = _grad_rows(root, g, param.dtype)
        grad = param.grad
        held = _rows_of(grad)
        if grad is None:
            param.grad = _partial_grad(root, rows)
        elif held is not None:
            core.write(grad, core.value(_partial_grad(root, held + rows)))
        else:  # a reduced gradient from an earlier backward: the rows are summed into it
            grad.add_(_partial_grad(root, rows))


def _annotate_grads(root: FSDP) -> None:
    """End of a backward outside ``no_sync``: every gradient is sharded like its parameter.

    A gradient still holding ``no_sync``'s per-device rows (its parameter got no gradient in this
    backward) or one a tied use outside its unit accumulated into is reduced to that sharding here.
    """
    root._fsdp_grads_queued = None
    for p in root.parameters():
        g = p.grad
        if not isinstance(g, XTensor) or core.annotation(p) is None:
            continue
        if core.is_view(g):  # a view (e.g. the transpose a matmul's backward returns): own storage
            g = p.grad = core.new_tensor(core.value(g))
        if core.annotation(g) is None:
            spmd_api.annotate(g, core.annotation(p))


def _tensors_of(tree):
    """The device tensors in (args, kwargs), and a function putting replacements back."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, XTensor)]

    def rebuild(new):
        out = list(leaves)
        for i, t in zip(positions, new):
            out[i] = t
        return torch.utils._pytree.tree_unflatten(out, spec)

    return [leaves[i] for i in positions], rebuild


# -- root hooks -------------------------------------------------------------------------------------


def _data_annotation(root: FSDP, t: torch.Tensor):
    spec = (root._fsdp_data_axes if len(root._fsdp_data_axes) > 1 else root._fsdp_data_axes[0],
            ) + (None,) * (t.dim() - 1)
    return sh.annotation(root._fsdp_mesh, spec, t.dim())


# [Note: FSDP without barriers]
# With ``optimization_barrier_in_forward=False`` and ``..._in_backward=False`` a step has no
# barrier, so XLA's CPU backend keeps its default scheduler and its all-reduce combiner (see [Note:
# barriers on the CPU backend]): every gather starts as early as its operand allows, and the
# gradient reductions merge into one. Measured on the small GPT+AdamW step (2 blocks, d 128,
# 8 virtual CPU devices, compiled): 1.06-1.13x a JAX program's step time with the barriers,
# 1.01-1.06x without. The price is memory: every unit's gathered parameters may be alive at once,
# and without the backward barrier XLA may reuse the forward's gathered values instead of
# gathering again (``reshard_after_forward`` then saves nothing). Temporaries per device of the
# whole step: 5.3 -> 7.9 MiB for that GPT, 170 -> 240 MiB for a 21 M one (4 blocks, d 512).


# [Note: FSDP gathers ordered by data]
# A unit's gathers are fenced by an optimisation barrier with the values they must wait for (the
# unit's inputs in forward, its incoming gradient in backward). XLA's CPU backend drops barriers
# before it schedules, so a graph with one gets the memory-optimised scheduler, which keeps
# program order (see [Note: barriers on the CPU backend]). That scheduler frees recomputed
# activations badly when a graph holds forward and backward without the optimizer step (a
# gradient-accumulation micro-step): a 6-block GPT under FSDP needed 53 MiB of temporaries per
# device with its blocks checkpointed, 48 MiB without. So on CPU, when the model holds a
# checkpointed module, the gathers wait for those values by data dependency (``ordered_after``)
# and the barrier only stops CSE; the default scheduler then needs 14.5 MiB for that graph (a full
# training step: 16.0 MiB either way). It is not done for every model: a dependency between
# values of different shapes costs a scalar collective per gather (the 29.5 M GPT step measured
# 20% slower), and without recomputation the memory-optimised scheduler holds fewer gathered
# parameters (1.0 unit against 1.5).
def _order_by_data(root: FSDP) -> bool:
    return runtime.platform() == "cpu" and any(
        getattr(m, "_xshard_checkpointed", False) for m in root.modules())


def _root_pre_forward(root: FSDP, args, kwargs):
    root._fsdp_order_by_data = _order_by_data(root)
    for p in root.parameters():
        if isinstance(p, XTensor) and core.annotation(p) is None:
            # ``p.data = t`` gave the parameter another storage, unsharded: shard it as FSDP did
            spmd_api.mark_sharding(p, root._fsdp_mesh, _spec(param_annotation(
                p, root._fsdp_mesh, root._fsdp_on_dim_0)))
    inputs, rebuild = _tensors_of((args, kwargs))
    mp = root._fsdp_mp
    out = []
    root._fsdp_replaced_inputs = []
    for original in inputs:
        t = original
        if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs and \
                t.is_floating_point():
            t = t.to(mp.param_dtype)
        if root._fsdp_shard_input and t.dim() >= 1 and not core.is_view(t) and \
                core.annotation(t) is None:
            t = spmd_api.ShardWithGradient.apply(t, _data_annotation(root, t))
        if t is not original:
            version = core.storage_version(core.storage(t))
            root._fsdp_replaced_inputs.append((original, t, version))
        out.append(t)
    return rebuild(out)


def _write_back_inputs(root: FSDP) -> None:
    """An input the forward wrote into in place (a KV cache it fills) was the sharded (or cast)
    copy the root hands its forward: the write is copied into the caller's tensor, as eager
    makes it there (it was lost)."""
    replaced, root._fsdp_replaced_inputs = root._fsdp_replaced_inputs, []
    for original, given, version in replaced:
        if core.storage_version(core.storage(given)) != version:
            original.copy_(given)


def _root_post_forward(root: FSDP, args, output):
    _write_back_inputs(root)
    if root._fsdp_shard_output is not None:
        return root._fsdp_shard_output(output, root._fsdp_mesh)
    if isinstance(output, XTensor):
        return _shard_batch(root, output)
    if isinstance(output, tuple) and output and isinstance(output[0], XTensor):
        if output[0].dim() >= 1:
            warnings.warn("FSDP shards only the first element of a tuple output; pass "
                          "shard_output=... to control the rest.", stacklevel=3)
        return (_shard_batch(root, output[0]),) + output[1:]
    return output


def _shard_batch(root: FSDP, t: XTensor):
    if t.dim() == 0:
        return t
    return spmd_api.ShardWithGradient.apply(t, _data_annotation(root, t))
