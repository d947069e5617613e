"""The lazy core: PyTorch ops on xshard tensors become IR, IR becomes one compiled XLA program.

The modules, in the order data flows through them:

==================  =================================================================================
stage               modules
==================  =================================================================================
device              ``runtime`` (platform, devices, the environment, read once), ``distributed``
                    (joining a multi-process run, the coordinator's key-value store, fail-fast),
                    ``backend`` (the ``xshard`` PyTorch device type), ``device`` (its factory
                    kernels)
dtypes              ``dtypes`` (PyTorch <-> numpy/JAX, host conversion without loss)
the IR              ``ir`` (the node type, and every op a node can hold), ``padding`` (values
                    padded to an uneven sharding's layout, and cropped back: host, device, IR)
tensors             ``tensor`` (``XTensor`` and the dispatcher), ``cells`` (storage, views, pending)
per-op facts        ``decompositions`` (xshard's own, where PyTorch has none or another than its
                    CPU kernel), ``ops`` (what the recorder knows of each aten overload, computed
                    once)
recording           ``record`` (arguments frozen into a template and an exact key; meta kernels;
                    nodes; in-place writes; view steps; factories), ``rng`` (the random stream)
transfers           ``transfer`` (host <-> device copies, reads)
CPU fallback        ``fallback`` (ops xshard cannot record, run eagerly on CPU)
lowering            ``lowering/`` (the table: one rule per op, a module per op family)
linearisation       ``graph`` (pending nodes in post-order, and the graph's key)
multi-process       ``divergence`` (every process checks the others run the same program on equal
                    data before it runs), ``arrays`` (global arrays from and to the host, and onto
                    other devices, without hidden collectives)
placement           ``placement`` (the default layout; one device assignment per graph, its inputs
                    moved onto it; results back in the default order; data moved between meshes)
compilation         ``compiler`` (the interpreter, ``jax.jit``, compiler options, the cache)
execution           ``capture`` (while ``xshard.compile`` records a whole step: reads, CPU ops and
                    syncs are handed to it), ``execute`` (sync, evaluate, wait, reads, compile-only)
==================  =================================================================================

Around them: ``barrier``, ``attention`` and ``rnn`` (device ops built from the above), ``autocast``
(``torch.autocast`` for the device), ``metrics``, ``trace`` (xshard's phases as profiler spans,
executable names, the XSHARD_DEBUG report: hooks that recording, compilation and execution call),
``debug`` (HLO of pending work), and ``api`` (what the layers above core use).

Imports point one way: a module imports only modules of a lower rank in this order (checked by
tests/core/test_layout.py), so a module can be read knowing only those below it:
runtime, distributed, dtypes, metrics, trace, ir, padding, cells, lowering, graph, divergence, arrays,
placement, compiler, capture, execute, rng, backend, decompositions, ops, record, transfer, fallback,
tensor, device, barrier, attention, rnn, autocast, debug, api. Recording comes after execution in
this order because reading a value (``t.item()``) runs pending work.
"""

from xshard.core import runtime  # noqa: F401  (configures JAX before anything imports it)
