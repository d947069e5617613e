"""MpDeviceLoader and ShardingSpec: batches arrive sharded, prefetched, with the values loaded."""

import collections
import threading

import numpy as np
import pytest
import torch

import xshard
import xshard.spmd as xs

DEV = xshard.device()
ROWS = "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"


@pytest.fixture(scope="module")
def mesh():
    return xs.Mesh(np.arange(8), (4, 2), ("data", "model"))


def batches(n, *shape):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g), torch.arange(shape[0]) + i) for i in range(n)]


def test_sharding_spec(mesh):
    spec = xs.ShardingSpec(mesh, ["data", None])
    assert spec.partition_spec == ("data", None) and not spec.minibatch
    assert spec.can_apply(torch.zeros(8, 4)) and not spec.can_apply(torch.zeros(8))
    assert spec == xs.ShardingSpec(mesh, ("data", None)) and hash(spec)  # frozen, hashable
    on_device = spec.apply(torch.arange(32.).reshape(8, 4))
    assert xs.get_sharding_spec(on_device) == ROWS
    torch.testing.assert_close(on_device.cpu(), torch.arange(32.).reshape(8, 4))
    t = torch.zeros(8, 4).to(DEV)
    assert spec.apply(t) is t and xs.get_sharding_spec(t) == ROWS
    with pytest.raises(ValueError, match=r"names mesh axis 'batch' at dimension 0"):
        xs.ShardingSpec(mesh, ("batch", None))
    with pytest.raises(TypeError, match="ShardingSpec needs an xshard.spmd.Mesh"):
        xs.ShardingSpec((4, 2), ("data", None))


def test_loader_with_one_spec(mesh):
    data = batches(3, 8, 4)
    loader = xs.MpDeviceLoader(data, DEV, input_sharding=xs.ShardingSpec(mesh, ("data", None)))
    assert len(loader) == 3
    seen = 0
    for (x, y), (rx, ry) in zip(loader, data):
        assert x.device == DEV and x._cell.value.is_data  # transferred, not pending
        assert xs.get_sharding_spec(x) == ROWS
        assert xs.get_sharding_spec(y) == ""  # rank 1: the spec does not apply, replicated
        torch.testing.assert_close(x.cpu(), rx)
        torch.testing.assert_close(y.cpu(), ry)
        seen += 1
    assert seen == 3


def test_loader_with_dict_of_specs_uneven_batch(mesh):
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(9, 4, generator=g), "y": torch.randn(9, generator=g),
             "mask": torch.ones(9, 4), "name": "b0"}]
    spec = {"x": xs.ShardingSpec(mesh, ("data", "model")),
            "y": xs.ShardingSpec(mesh, (("data", "model"),)), "mask": None, "name": None}
    (batch,) = list(xs.MpDeviceLoader(data, DEV, input_sharding=spec))
    assert xs.get_sharding_spec(batch["x"]) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert xs.get_sharding_spec(batch["y"]) == "{devices=[8]0,1,2,3,4,5,6,7}"
    assert xs.get_sharding_spec(batch["mask"]) == ""
    assert batch["name"] == "b0"
    for key in ("x", "y", "mask"):
        assert tuple(batch[key].shape) == tuple(data[0][key].shape)
        torch.testing.assert_close(batch[key].cpu(), data[0][key])
    # The shards hold the rows directly (padded at the end), ready for a step.
    torch.testing.assert_close((batch["x"] * batch["mask"]).sum(0).cpu(), data[0]["x"].sum(0))


def test_loader_feeds_a_training_step(mesh):
    torch.manual_seed(0)
    w_ref = torch.randn(4, 2)
    w = w_ref.to(DEV).requires_grad_()
    data = batches(2, 8, 4)
    for x, _ in xs.MpDeviceLoader(data, DEV, input_sharding=xs.ShardingSpec(mesh, ("data", None))):
        (x @ w).square().sum().backward()
        xshard.sync()
    expected = sum(2 * rx.t() @ (rx @ w_ref) for rx, _ in data)
    torch.testing.assert_close(w.grad.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_missing_key_and_non_dict_batch(mesh):
    spec = {"x": xs.ShardingSpec(mesh, ("data", None))}
    loader = xs.MpDeviceLoader([{"x": torch.zeros(8, 4), "y": torch.zeros(8)}], DEV,
                               input_sharding=spec)
    with pytest.raises(KeyError, match=r"The batch has key 'y', which input_sharding does not "
                                       r"list; available keys: \['x'\]"):
        list(loader)
    loader = xs.MpDeviceLoader([(torch.zeros(8, 4),)], DEV, input_sharding=spec)
    with pytest.raises(ValueError, match=r"input_sharding is a dict of ShardingSpecs \(keys "
                                         r"\['x'\]\), so each batch must be a dict.*tuple"):
        list(loader)


def test_minibatch(mesh):
    spec = xs.ShardingSpec(mesh, ("data", None), minibatch=True)
    (x,) = list(xs.MpDeviceLoader([torch.arange(16.).reshape(8, 2)], DEV, input_sharding=spec))
    assert xs.get_sharding_spec(x) == ROWS  # one process: the batch is the global batch
    torch.testing.assert_close(x.cpu(), torch.arange(16.).reshape(8, 2))
    loader = xs.MpDeviceLoader([torch.zeros(6, 2)], DEV, input_sharding=spec)
    with pytest.raises(RuntimeError, match=r"When minibatch is configured, the per-host batch size "
                                           r"must be divisible.*batch of 6 for 4 local shards"):
        list(loader)


def test_constructor_errors(mesh):
    with pytest.raises(ValueError, match="moves batches to the xshard device, got device 'cpu'"):
        xs.MpDeviceLoader([], "cpu")
    with pytest.raises(TypeError, match="input_sharding must be a ShardingSpec, a dict of them"):
        xs.MpDeviceLoader([], DEV, input_sharding=("data", None))
    with pytest.raises(TypeError, match=r"input_sharding\['x'\] is a tuple"):
        xs.MpDeviceLoader([], DEV, input_sharding={"x": ("data", None)})
    with pytest.raises(ValueError, match="prefetch must be a non-negative int"):
        xs.MpDeviceLoader([], DEV, prefetch=-1)


def test_prefetch_transfers_the_next_batch_during_the_step(mesh):
    fetched = [threading.Event() for _ in range(3)]

    def source():
        for i in range(3):
            yield torch.full((8, 4), float(i))
            fetched[i].set()  # the loader asked for the batch after i

    loader = xs.MpDeviceLoader(source(), DEV, input_sharding=xs.ShardingSpec(mesh, ("data", None)))
    it = iter(loader)
    first = next(it)
    # While "step 0" runs, the background thread already pulls (and transfers) batch 1.
    assert fetched[0].wait(timeout=10)
    out = [first] + list(it)
    assert [float(b.cpu()[0, 0]) for b in out] == [0.0, 1.0, 2.0]
    assert all(xs.get_sharding_spec(b) == ROWS for b in out)


def test_no_prefetch_and_loader_errors_propagate(mesh):
    spec = xs.ShardingSpec(mesh, ("data", None))
    out = list(xs.MpDeviceLoader([torch.ones(8, 4)], DEV, input_sharding=spec, prefetch=0))
    assert xs.get_sharding_spec(out[0]) == ROWS

    def broken():
        yield torch.ones(8, 4)
        raise OSError("disk gone")

    it = iter(xs.MpDeviceLoader(broken(), DEV, input_sharding=spec))
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_send_cpu_data_to_device(mesh):
    x = torch.randn(8, 4)
    out = xs.send_cpu_data_to_device([x, {"k": x}], DEV, xs.ShardingSpec(mesh, (None, "model")))
    assert xs.get_sharding_spec(out[1]["k"]) == \
        "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    torch.testing.assert_close(out[0].cpu(), x)


def test_abandoned_iterator_stops_its_thread(mesh):
    import gc

    def endless():
        while True:
            yield torch.zeros(8, 4)

    spec = xs.ShardingSpec(mesh, ("data", None))
    it = iter(xs.MpDeviceLoader(endless(), DEV, input_sharding=spec))
    next(it)
    thread = it._worker.thread
    del it
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_batches_of_any_structure(mesh):
    """Tuples, lists, namedtuples, dicts and mappings PyTorch's pytree does not know (a
    tokenizer's BatchEncoding is a UserDict: it keeps its type and attributes, as torch_xla's
    loader keeps them; it became a dict, and batch.input_ids failed) all arrive with their
    tensors on the device."""
    import collections

    class Encoding(collections.UserDict):  # as transformers' BatchEncoding
        def __init__(self, data, n_sequences):
            super().__init__(data)
            self.n_sequences = n_sequences

        def __getattr__(self, name):
            try:
                return self.data[name]
            except KeyError:
                raise AttributeError(name) from None

    Pair = collections.namedtuple("Pair", "x y")
    spec = xs.ShardingSpec(mesh, ("data", None))
    encoding = Encoding({"ids": torch.arange(16).reshape(8, 2)}, n_sequences=1)
    batch = {"pair": Pair(torch.ones(8, 2), [torch.zeros(8, 3), 5]), "encoding": encoding,
             "name": "b"}
    got = xs.send_cpu_data_to_device(batch, input_sharding=spec)
    assert isinstance(got["pair"], Pair) and got["name"] == "b" and got["pair"].y[1] == 5
    assert type(got["encoding"]) is Encoding and got["encoding"].n_sequences == 1
    assert got["encoding"].ids is got["encoding"]["ids"] and encoding.ids.device.type == "cpu"
    for t in (got["pair"].x, got["pair"].y[0], got["encoding"]["ids"]):
        assert t.device == xshard.device()
        assert xs.get_sharding_spec(t).startswith("{devices=[4,1,2]")
    assert torch.equal(got["encoding"]["ids"].cpu(), torch.arange(16).reshape(8, 2))


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i


def test_a_pass_left_early_stops_before_the_next_starts():
    """A DataLoader with persistent workers has one iterator, which each pass resets: the thread
    of a pass left with ``break`` was still inside it, and the next pass failed in the
    DataLoader (or, rarely, lost a batch)."""
    data = torch.utils.data.DataLoader(_Rows(), batch_size=4, num_workers=2,
                                       persistent_workers=True)
    loader = xs.MpDeviceLoader(data, DEV)
    expected = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    for epoch in range(6):
        for i, _ in enumerate(loader):
            if i == epoch % 3:
                break
        assert [b[1].cpu().tolist() for b in loader] == expected
    # Two passes at once are still two passes (without persistent workers, as in PyTorch).
    loader = xs.MpDeviceLoader(torch.utils.data.DataLoader(_Rows(), batch_size=4), DEV)
    pairs = list(zip(loader, loader))
    assert [(a[1].cpu().tolist(), b[1].cpu().tolist()) for a, b in pairs] == \
        [(e, e) for e in expected]


def test_a_one_shot_source_goes_on_where_the_last_pass_stopped():
    """The batches a pass left early had taken (prefetched) come first in the next pass over a
    generator (they were lost; or two threads read the generator at once)."""
    def stream():
        for i in range(10):
            yield torch.full((8, 2), float(i))

    loader = xs.MpDeviceLoader(stream(), DEV, prefetch=2)
    first = [int(b[0, 0].item()) for _, b in zip(range(2), loader)]
    assert first == [0, 1]
    assert [int(b[0, 0].item()) for b in loader] == list(range(2, 10))


def test_dict_batches_keep_their_mapping_type(mesh):
    """A defaultdict batch with a dict of specs (rebuilding it raised TypeError)."""
    batch = collections.defaultdict(list, x=torch.ones(8, 2), y=torch.arange(8))
    spec = {"x": xs.ShardingSpec(mesh, ("data", None)), "y": None}
    got = next(iter(xs.MpDeviceLoader([batch], DEV, input_sharding=spec)))
    assert type(got) is collections.defaultdict and got.default_factory is list
    assert got["x"].device == DEV and got["y"].cpu().tolist() == list(range(8))


def test_dataclass_batches_arrive_on_the_device(mesh):
    """Their tensors stayed on the CPU (the first op then raised a device mismatch)."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        labels: list
        name: str = "train"

    batch = Batch(torch.ones(8, 2), [torch.arange(8), 3])
    got = next(iter(xs.MpDeviceLoader([batch], DEV,
                                      input_sharding=xs.ShardingSpec(mesh, ("data", None)))))
    assert type(got) is Batch and got.name == "train" and got.labels[1] == 3
    assert got.x.device == DEV and got.labels[0].device == DEV
    assert torch.equal(got.x.cpu(), batch.x) and got.labels[0].cpu().tolist() == list(range(8))
    assert xs.get_sharding_spec(got.x) != xs.get_sharding_spec(got.labels[0])
