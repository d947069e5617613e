"""Auto-wrap policy decisions on small module trees, checked through ``select_units`` (no devices)."""

import functools

import pytest
import torch.nn as nn

from xshard.fsdp import (always_wrap_policy, lambda_auto_wrap_policy, select_units,
                         size_based_auto_wrap_policy, transformer_auto_wrap_policy)


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc1 = nn.Linear(d, d)  # 72 params
        self.fc2 = nn.Linear(d, d)  # 72 params


class Net(nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        self.embed = nn.Embedding(10, d)  # 80 params
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)  # 18 params


def names(root, units):
    by_id = {id(m): name or "<root>" for name, m in root.named_modules()}
    return [by_id[id(u)] for u in units]


def size_policy(**kw):
    return functools.partial(size_based_auto_wrap_policy, **kw)


def test_no_policy_only_the_root_is_a_unit():
    net = Net()
    assert names(net, select_units(net, None)) == ["<root>"]


def test_root_is_always_the_last_unit():
    net = Net()
    units = select_units(net, always_wrap_policy)
    assert units[-1] is net
    assert units.count(net) == 1


def test_always_wrap_policy_wraps_every_module_innermost_first():
    net = Net(n=2)
    got = names(net, select_units(net, always_wrap_policy))
    assert got == ["embed", "blocks.0.fc1", "blocks.0.fc2", "blocks.0", "blocks.1.fc1",
                   "blocks.1.fc2", "blocks.1", "blocks", "head", "<root>"]


def test_transformer_policy_wraps_each_layer_class():
    net = Net()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert names(net, select_units(net, policy)) == ["blocks.0", "blocks.1", "blocks.2", "<root>"]


def test_pytorch_module_wrap_policy_object():
    """PyTorch's own policy objects work as they do with PyTorch FSDP."""
    from xshard.fsdp import ModuleWrapPolicy

    net = Net()
    assert names(net, select_units(net, ModuleWrapPolicy({Block}))) == [
        "blocks.0", "blocks.1", "blocks.2", "<root>"]


def test_transformer_policy_several_classes():
    net = Net()
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={Block, nn.Embedding})
    assert names(net, select_units(net, policy)) == ["embed", "blocks.0", "blocks.1", "blocks.2",
                                                     "<root>"]


def test_transformer_policy_takes_one_class_or_refuses_non_classes():
    net = Net()
    one = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=Block)
    assert names(net, select_units(net, one)) == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    bad = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={"Block"})
    with pytest.raises(TypeError, match="transformer_layer_cls must hold module classes, got "
                                        "'Block'"):
        select_units(net, bad)


@pytest.mark.parametrize("policy, match", [
    ("size", "auto_wrap_policy must be a callable or None, got 'size'"),
    (lambda m: True, "cannot be called as policy\\(module=..., recurse=..., nonwrapped_numel"),
    (functools.partial(size_based_auto_wrap_policy, min_params=10), "cannot be called as"),
])
def test_policies_that_cannot_be_called_are_refused(policy, match):
    with pytest.raises(TypeError, match=match):
        select_units(Net(), policy)


def test_lambda_policy():
    net = Net()
    policy = functools.partial(lambda_auto_wrap_policy,
                               lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features == 2)
    assert names(net, select_units(net, policy)) == ["head", "<root>"]


def test_size_policy_threshold_below_a_block():
    # A block has 144 parameters: a threshold of 100 makes each Linear (72) too small, each block
    # large enough; the ModuleList holding them is never a unit.
    net = Net()
    assert names(net, select_units(net, size_policy(min_num_params=100))) == [
        "blocks.0", "blocks.1", "blocks.2", "<root>"]


def test_size_policy_threshold_below_a_linear():
    net = Net()
    got = names(net, select_units(net, size_policy(min_num_params=70)))
    assert got == ["embed", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2",
                   "blocks.2.fc1", "blocks.2.fc2", "<root>"]


def test_size_policy_counts_only_parameters_not_already_in_a_unit():
    # With min 300: no block alone (144) is large; blocks (432) is a ModuleList (excluded); the
    # root holds everything and is the only unit.
    net = Net()
    assert names(net, select_units(net, size_policy(min_num_params=300))) == ["<root>"]
    # With min 145: blocks.0 (144) is not large; nothing inside blocks is wrapped.
    assert names(net, select_units(net, size_policy(min_num_params=145))) == ["<root>"]


def test_size_policy_large_threshold_wraps_nothing_but_root():
    net = Net()
    assert names(net, select_units(net, size_policy())) == ["<root>"]  # default 1e8


def test_size_policy_module_list_and_dict_never_units():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.ModuleList([nn.Linear(20, 20)])
            self.table = nn.ModuleDict({"a": nn.Linear(20, 20)})

    net = Holder()
    got = names(net, select_units(net, size_policy(min_num_params=400)))
    assert got == ["items.0", "table.a", "<root>"]
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}


def test_size_policy_multihead_attention_is_a_leaf():
    # As in PyTorch FSDP, a force-leaf module is not recursed into (its out_proj, 272 params, is
    # never split off) and is not a unit itself: its parameters belong to the unit above it.
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2)  # 1088 params
            self.norm = nn.LayerNorm(16)

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

    net = Top()
    assert nn.MultiheadAttention in size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    got = names(net, select_units(net, size_policy(min_num_params=200)))
    assert got == ["layers.0", "layers.1", "<root>"]
    # Without the leaf rule the policy would split out_proj off.
    got = names(net, select_units(net, size_policy(min_num_params=200, force_leaf_modules=set())))
    assert "layers.0.mha.out_proj" in got


def test_size_policy_force_leaf_and_exclude_overrides():
    net = Net()
    # Blocks as leaves: nothing inside them is split off, and (as in PyTorch) they are not units
    # themselves either; their parameters stay with the root.
    got = names(net, select_units(net, size_policy(min_num_params=70, force_leaf_modules={Block})))
    assert got == ["embed", "<root>"]
    # Excluding Linear: the Linears are not units, the blocks above them are.
    got = names(net, select_units(net, size_policy(min_num_params=100,
                                                   exclude_wrap_modules={nn.Linear})))
    assert got == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    # With an empty exclusion set the ModuleList itself may be a unit.
    got = names(net, select_units(net, size_policy(min_num_params=300, exclude_wrap_modules=set())))
    assert got == ["blocks", "<root>"]


def test_nested_units():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Block()
            self.extra = nn.Linear(8, 8)

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer = Outer()

    net = Top()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, Outer})
    # The inner block is a unit inside the outer one; the outer unit keeps only its own params.
    assert names(net, select_units(net, policy)) == ["outer.inner", "outer", "<root>"]


def test_policy_signature_is_pytorchs():
    # PyTorch FSDP users call policies with these keywords; positional use works too.
    net = Net()
    assert size_based_auto_wrap_policy(module=net, recurse=True, nonwrapped_numel=10**9)
    assert not size_based_auto_wrap_policy(net, False, 10, min_num_params=100)
    assert transformer_auto_wrap_policy(net, True, 0, transformer_layer_cls={Block})
    assert not transformer_auto_wrap_policy(net, False, 0, transformer_layer_cls={Block})
    assert always_wrap_policy(net, False, 0)


@pytest.mark.parametrize("threshold,expected", [(0, 12), (73, 5), (100, 4), (10**6, 1)])
def test_size_policy_unit_count(threshold, expected):
    net = Net()
    assert len(select_units(net, size_policy(min_num_params=threshold))) == expected
