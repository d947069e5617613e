"""A training step traced once and run as one compiled program per call (``xshard.compile``).

Modules, in the order a call flows through them:

- ``state.py``: where the step's tensors live (slots) and how they are found from the function;
- ``optim.py``: what torch.optim needs so that one recording serves every step;
- ``compiled.py``: recording the step on the lazy tracer, the program it becomes, replaying it;
- ``errors.py``: what a compiled step refuses, naming the user's line;
- ``dynamo.py``: ``torch.compile`` on xshard tensors (the lazy path, one warning).
"""

from xshard.step import dynamo as _dynamo
from xshard.step.compiled import CompiledStep
from xshard.step.errors import CaptureError, CompileError, StateError

_dynamo.install()

__all__ = ["compile", "CompiledStep", "CompileError", "CaptureError", "StateError"]


def compile(fn=None, *, state=(), static_argnums=(), static_argnames=(), name=None):
    """Compiles a whole training step (forward, backward, optimizer step) into one program.

    The first call records ``fn`` once on xshard's lazy tracer and compiles everything it does
    (forward, ``backward()``, ``optimizer.step()``, ``zero_grad()``) as one XLA executable; later
    calls with arguments of the same shapes, dtypes and shardings (and the same state) run that
    executable directly: no op is recorded, no graph built. Parameters, gradients, optimizer state
    and buffers are updated in place, keeping their shardings; learning rates (read from the
    optimizer on every call), Python numbers passed as arguments and the random stream are inputs
    of the program, so schedulers and dropout work without recompiling. Any other change (a new
    input shape, a new param group, ``model.eval()``) records the step again, logging what changed
    (logger ``xshard``, level INFO).

    As with ``jax.jit``, the step's Python runs only while it is recorded: it must not read tensor
    values (``.item()``, ``print(t)``, ``if loss > 0``) nor depend on Python state that changes
    between calls; call ``scheduler.step()`` outside it. The model and optimizer are found in the
    arguments, the closure, the globals the function names and the object a method is bound to,
    or given as ``state``.

    Args:
        fn: the step, e.g. ``def step(x, y): loss = loss_fn(model(x), y); loss.backward();
            opt.step(); opt.zero_grad(); return loss``.
        state: modules, optimizers or device tensors the step uses that ``fn`` does not name.
        static_argnums: positions of arguments that are part of the program (compared by value;
            a new value records the step again) instead of inputs. Python ``int``/``float``
            arguments are otherwise inputs: the step receives them as 0-d device tensors.
        static_argnames: the same for keyword arguments.
        name: the name used in messages (default ``fn.__name__``).

    Returns:
        A ``CompiledStep``, called like ``fn``; it returns what ``fn`` returns, with each tensor a
        fresh device tensor (``loss.item()`` after the call reads it).

    Example:
        >>> @xshard.compile
        ... def train_step(x, y):
        ...     loss = F.cross_entropy(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        ...     opt.zero_grad()
        ...     return loss
        >>> for x, y in loader:                                    # doctest: +SKIP
        ...     loss = train_step(x.to(dev), y.to(dev))
        ...     scheduler.step()
    """
    def wrap(f):
        return CompiledStep(f, state=state, static_argnums=static_argnums,
                            static_argnames=static_argnames, name=name)

    return wrap if fn is None else wrap(fn)
