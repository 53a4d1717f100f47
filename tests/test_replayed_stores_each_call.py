"""The generated replay of a compiled entry's stores (compile/replay_code.py) reads each call's argument once and
walks from it to every store's target afresh: a new cache object of the same structure, its layer list
replaced, or one layer swapped between calls gets the stores eager makes, and stored outputs keep eager's
`requires_grad`. Differential against eager on twin objects."""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class Cache:
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers


class Appending(nn.Module):
    """A dynamic cache's update: each block stores a new tensor on its cache layer (`layer.keys = cat(...)`)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for i, lin in enumerate(self.lins):
            layer = cache.layers[i]
            x = lin(x) + layer.keys.sum(0)
            layer.keys = self.stored(torch.cat([layer.keys[1:], x[:1]]))
        return x

    def stored(self, keys: torch.Tensor) -> torch.Tensor:
        return keys


def twins(n: int = 4) -> tuple[Cache, Cache]:
    keys = [torch.randn(3, 4) for _ in range(n)]
    return Cache([Layer(k.clone()) for k in keys]), Cache([Layer(k.clone()) for k in keys])


def same(fn, reference, x, ours: Cache, theirs: Cache) -> None:
    torch.testing.assert_close(fn(x, ours), reference(x, theirs))
    assert len(ours.layers) == len(theirs.layers)
    for a, b in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(a.keys, b.keys)
        assert a.keys.requires_grad == b.keys.requires_grad


def models():
    torch.manual_seed(0)
    model, reference = Appending(), Appending()
    reference.load_state_dict(model.state_dict())
    return stampout.compile(model, backend="eager"), reference


def test_stores_follow_a_new_cache_a_new_layer_list_and_a_swapped_layer():
    fn, reference = models()
    x = torch.randn(2, 4)
    with torch.no_grad():
        ours, theirs = twins()
        for _ in range(3):
            same(fn, reference, x, ours, theirs)
        ours, theirs = twins()  # a new cache object of the same structure
        for _ in range(2):
            same(fn, reference, x, ours, theirs)
        ours.layers, theirs.layers = list(ours.layers), list(theirs.layers)  # the list replaced, same layers
        same(fn, reference, x, ours, theirs)
        k = torch.randn(3, 4)
        ours.layers[2], theirs.layers[2] = Layer(k.clone()), Layer(k.clone())  # one layer swapped
        for _ in range(2):
            same(fn, reference, x, ours, theirs)
    assert fn.stats.captures == 1


def test_stored_outputs_keep_eagers_requires_grad():
    fn, reference = models()
    x = torch.randn(2, 4)
    ours, theirs = twins()
    for _ in range(3):  # grad mode: the stored keys are graph outputs that require grad, as in eager
        same(fn, reference, x, ours, theirs)
        for layer in [*ours.layers, *theirs.layers]:
            layer.keys = layer.keys.detach()
    with torch.no_grad():
        for _ in range(2):
            same(fn, reference, x, ours, theirs)


class ByName(nn.Module):
    """Stores through a dict of layers (`cache.by_name["b"].keys = ...`) and into an attribute that is no Python
    identifier (`setattr(layer, "last out", x)`): read inline (`r0.by_name['b']`) or kept as setattr."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        for name in ("a", "b"):
            layer = cache.by_name[name]
            x = self.lin(x) + layer.keys.sum(0)
            layer.keys = torch.cat([layer.keys[1:], x[:1]])
            setattr(layer, "last out", x * 2)
        return x


def test_stores_through_dict_items_and_non_identifier_attributes_match_eager():
    torch.manual_seed(0)
    model, reference = ByName(), ByName()
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    keys = {name: torch.randn(3, 4) for name in ("a", "b")}
    ours, theirs = (Cache([]), Cache([]))
    for cache in (ours, theirs):
        cache.by_name = {name: Layer(k.clone()) for name, k in keys.items()}
    with torch.no_grad():
        for step in range(4):
            if step == 2:  # a layer swapped in the dict between calls: the stores go to the new one
                k = torch.randn(3, 4)
                ours.by_name["b"], theirs.by_name["b"] = Layer(k.clone()), Layer(k.clone())
            torch.testing.assert_close(fn(x, ours), reference(x, theirs))
            for name in ("a", "b"):
                a, b = ours.by_name[name], theirs.by_name[name]
                torch.testing.assert_close(a.keys, b.keys)
                torch.testing.assert_close(getattr(a, "last out"), getattr(b, "last out"))
    assert fn.stats.captures == 1


class Detaching(Appending):
    """Stores a value it computes without autograd (`.detach()`: the capture takes it as an output without autograd)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n)

    def stored(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.detach()


def _grad_handing(gm, example):
    """A backend that hands back every floating output as requiring grad (as AOTAutograd may)."""

    def run(*args):
        return tuple(o.detach().requires_grad_() if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                     for o in gm(*args))

    return run


def test_outputs_taken_without_autograd_are_stored_detached_when_the_backend_hands_them_requiring_grad():
    """The replay tests all such outputs at once (natively) and stores them as they are only where none requires
    grad: here every one does, and each stored value must be detached, as eager's are."""
    from stampout.torch_internals import grad_free

    torch.manual_seed(0)
    model, reference = Detaching(), Detaching()
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend=_grad_handing)
    x = torch.randn(2, 4)
    keys = [torch.randn(3, 4) for _ in range(3)]
    ours, theirs = Cache([Layer(k.clone()) for k in keys]), Cache([Layer(k.clone()) for k in keys])
    for _ in range(3):
        fn(x, ours)
        reference(x, theirs)
        for a, b in zip(ours.layers, theirs.layers):
            torch.testing.assert_close(a.keys, b.keys)
            assert not b.keys.requires_grad and not a.keys.requires_grad
    assert fn.stats.captures == 1
    assert not grad_free([torch.zeros(1, requires_grad=True)])
    assert not grad_free([torch.zeros(1, requires_grad=True) * 2])  # (a grad_fn counts)
    assert not grad_free([torch.zeros(1), 1])  # (not a tensor)
    assert not grad_free([nn.Parameter(torch.zeros(1), requires_grad=False)])  # (not a plain tensor: tested one by one)

