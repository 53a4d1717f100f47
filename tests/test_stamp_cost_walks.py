"""What a capture pays per stamped layer after the program ran: each module is opened once by the whole walks that
look for traced values left behind (the left-over pass, the stuck-fake check and the world repair share what one walk
found clean), and a path to a parameter hashes from its parent's hash, equal to a path spelled again. Counts, not
times: the walks' soundness is test_world_shared_objects' (a fake left by layer 20 of 32 is still found)."""

from __future__ import annotations

import collections
import importlib
import logging

import pytest
import torch
from blocks import RegionStack
from torch import nn

import stampout
from stampout import config
from stampout.sources import Arg, Attr
from stampout.trace import structure


class Config:
    def __init__(self) -> None:
        self.eps = 1e-5
        self.sizes = [8, 8]


class Layer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) + self.cfg.eps


class Stack(RegionStack):
    def __init__(self, n: int) -> None:
        cfg = Config()
        super().__init__(Layer(cfg) for _ in range(n))


def count_opened(monkeypatch, key) -> collections.Counter:
    """How often the whole walk opens each value, by `key(value)`: a module by its fields (_module_fields, which the
    walk for fakes calls directly), anything else by referents."""
    opened: collections.Counter = collections.Counter()
    referents, module_fields = structure.referents, structure._module_fields

    def counting(v):
        if not isinstance(v, nn.Module):
            opened[key(v)] += 1
        return referents(v)

    def counting_fields(v):
        opened[key(v)] += 1
        return module_fields(v)

    monkeypatch.setattr(structure, "referents", counting)
    monkeypatch.setattr(structure, "_module_fields", counting_fields)
    return opened


def test_each_layer_module_is_opened_once_by_the_whole_walks(monkeypatch) -> None:
    model = Stack(8)
    opened = count_opened(monkeypatch, id)
    monkeypatch.setattr(config, "check_world", False)  # (the suite's own check after the repairs walks again)
    x = torch.randn(2, 8)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 7)
    torch.testing.assert_close(cap(x), model(x))
    for layer in model.layers[1:]:  # (the stamped ones: a traced layer's own trace walks what it left too)
        for m in layer.modules():
            assert opened[id(m)] == 1, (type(m).__name__, opened[id(m)])
    assert opened[id(model.layers[0].cfg)] == 1


def test_a_path_hashes_as_the_same_path_spelled_again() -> None:
    def path():
        return Attr(Attr(Attr(Attr(Arg(0, "self"), "layers"), "3"), "lin"), "weight")

    a, b = path(), path()
    hash(a.parent)  # (one parent's hash cached, the other's not)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert Attr(Arg(0, "self"), "w") != Attr(Arg(1, "x"), "w")


def test_a_capture_lists_the_module_tree_once_before_and_once_after_the_run(monkeypatch) -> None:
    """Each listing opens every module of the model: a capture lists the tree once while no Python of the program
    has run (the lazy-module and backward-hook checks, the world's snapshot) and once after (the left-over pass,
    the world repair), not once per pass."""
    program = importlib.import_module("stampout.capture.program")
    leftovers = importlib.import_module("stampout.capture.leftovers")
    listed = []
    modules_of = leftovers.modules_of

    def counting(fn):
        listed.append(fn)
        return modules_of(fn)

    monkeypatch.setattr(program, "modules_of", counting)
    monkeypatch.setattr(leftovers, "modules_of", counting)
    opened: collections.Counter = collections.Counter()
    model = Stack(4)
    for m in model.modules():  # (and no pass walks `modules()` from each module of the tree again)
        monkeypatch.setattr(m, "modules", lambda m=m, f=m.modules: opened.update([id(m)]) or f())
    x = torch.randn(2, 8)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3)
    torch.testing.assert_close(cap(x), model(x))
    assert len(listed) == 2
    assert all(opened[id(m)] == 0 for m in model.modules() if m is not model), opened


def test_a_backward_hook_is_refused_with_the_path_of_its_module() -> None:
    model = Stack(3)
    model.layers[2].lin.register_full_backward_hook(lambda *_: None)
    with pytest.raises(stampout.StampoutError, match=r"Stack\.layers\.2\.lin has a module backward hook"):
        stampout.capture(model, torch.randn(2, 8))


def test_the_walk_for_fakes_opens_no_real_tensor_and_no_empty_registry(monkeypatch) -> None:
    """A module tree is mostly parameters and empty hook dicts and sets: the whole walk for fakes passes over them
    (a real tensor reaches nothing; an empty container holds nothing), and still finds a fake anywhere else."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = Stack(4)
    opened = count_opened(monkeypatch, type)
    assert not structure.holds_fake(list(model.modules()), whole=True)
    assert opened[nn.Parameter] == opened[torch.Tensor] == opened[set] == 0, opened
    assert opened[Layer] == 4
    with FakeTensorMode():
        fake = torch.randn(2)
        fake_param = nn.Parameter(torch.randn(2))
    model.layers[2].lin.seen = [1, (2, fake)]
    assert structure.holds_fake(list(model.modules()), whole=True)
    del model.layers[2].lin.seen
    model.layers[3].norm._non_persistent_buffers_set.add(fake)  # (a set the walk skips only when empty)
    assert structure.holds_fake(list(model.modules()), whole=True)
    model.layers[3].norm._non_persistent_buffers_set.clear()
    model.layers[1].lin._parameters["extra"] = fake_param  # (a Parameter made of a fake is a FakeTensor)
    assert structure.holds_fake(list(model.modules()), whole=True)
    assert structure.holds_fake([{"k": fake_param}], whole=True, tensors_only=True) is True


class Disguised(nn.Module):  # (a class that answers isinstance through its own `__class__`)
    @property
    def __class__(self):
        return nn.Module


@pytest.mark.parametrize("where", ["dict key", "nested dict", "buffer", "attribute", "hook", "disguised module"])
def test_the_walk_for_fakes_opens_modules_and_dicts_directly_and_finds_a_fake_they_hold(where) -> None:
    """The walk for fakes opens a dict and a module (of a class neither fakes predicate could accept) without asking
    the predicate or referents: a fake anywhere they hold is still found, a key as well as a value, for either
    predicate and with or without the pass's clean objects."""
    import functools

    from torch._subclasses.fake_tensor import FakeTensorMode

    model = Stack(3)
    with FakeTensorMode():
        fake = torch.randn(2)
    layer = model.layers[1]
    store = {
        "dict key": lambda: setattr(layer.lin, "memo", {fake: 1}),
        "nested dict": lambda: setattr(layer.lin, "memo", {"k": {"j": [fake]}}),
        "buffer": lambda: layer.norm._buffers.__setitem__("b", fake),
        "attribute": lambda: layer.__dict__.__setitem__("cache", fake),
        "hook": lambda: layer.lin._forward_hooks.__setitem__(7, functools.partial(print, fake)),
        "disguised module": lambda: setattr(layer, "inner", Disguised()) or layer.inner.__dict__.__setitem__("c", fake),
    }[where]
    assert not structure.holds_fake(list(model.modules()), whole=True)
    store()
    for tensors_only in (False, True):
        assert structure.holds_fake(list(model.modules()), tensors_only=tensors_only, whole=True)
        assert structure.holds_fake(list(model.modules()), tensors_only=tensors_only, whole=True, clean={})
    assert structure._module_class(Layer) and not structure._module_class(Disguised)


class OwnListing(nn.Module):
    """Lists only itself: its submodules are not part of `modules()`."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self


def _trees() -> list[nn.Module]:
    shared = nn.Linear(2, 2)
    with_none = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, nn.Tanh()))
    with_none.register_module("empty", None)
    shadowed = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    shadowed[1].named_modules = lambda *a, **k: iter([("", shadowed[1])])  # (an instance's own listing)
    return [Stack(3), with_none, nn.Sequential(nn.Linear(2, 2), OwnListing(), nn.Sequential(OwnListing())), shadowed]


@pytest.mark.parametrize("tree", range(4))
def test_the_module_tree_listing_is_nn_modules_own(tree) -> None:
    """names.module_tree (the capture's listing of the program's modules, without named_modules' generators) gives
    the modules `modules()` gives, in its order, each once: shared modules, None entries, and a class or an instance
    with a listing of its own (then it is that listing)."""
    from stampout.trace.names import module_tree

    root = _trees()[tree]
    listed = module_tree(root)
    assert len(listed) == len(list(root.modules()))
    assert all(a is b for a, b in zip(listed, root.modules()))


class ValuesOwnDict(dict):
    """A `_modules` whose `values()` are not its items (the walk would list other modules than nn.Module's)."""

    def values(self):
        return []


def test_a_watched_model_is_listed_by_the_walk_and_an_odd_modules_dict_by_modules(monkeypatch) -> None:
    """A compiled model's `_modules` are watched dicts (watch/tracking._BumpingDict: dict's items and values): the
    walk lists them itself, as for plain dicts (before, every capture after the first called `modules()`); a dict
    subclass with its own `values` is listed by `modules()`."""
    from stampout.trace.names import module_tree

    model = Stack(3)
    stampout.compile(model, backend="eager")(torch.randn(2, 8))
    assert type(model._modules) is not dict
    expected = list(model.modules())
    listings = []
    monkeypatch.setattr(nn.Module, "modules", lambda self: listings.append(self) or iter(expected))
    listed = module_tree(model)
    assert not listings and len(listed) == len(expected) and all(a is b for a, b in zip(listed, expected))
    model.__dict__["_modules"] = ValuesOwnDict(model._modules)
    module_tree(model)
    assert listings == [model]


class CountingConfig:
    """A config answering attribute reads in Python (as transformers' PretrainedConfig does): each `__class__` read,
    which isinstance makes of a value whose class is not the one asked about, is counted."""

    reads = 0

    def __init__(self) -> None:
        self.eps = 1e-5

    def __getattribute__(self, name):
        if name == "__class__":
            type(self).reads += 1
        return object.__getattribute__(self, name)


class ConfigLayer(nn.Module):
    def __init__(self, cfg: CountingConfig) -> None:
        super().__init__()
        self.config = cfg
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


class ConfigStack(RegionStack):
    def __init__(self, n: int) -> None:
        cfg = CountingConfig()
        super().__init__(ConfigLayer(cfg) for _ in range(n))
        self.config = cfg


def test_a_config_every_layer_holds_is_not_asked_its_class_per_layer() -> None:
    """The passes over the module tree (tensor names, the fields noted before the run) take a tensor by its class and
    note a shared config once: the config's Python `__getattribute__` is not run again for each layer holding it."""
    reads = []
    for n in (2, 8):
        model = ConfigStack(n)
        x = torch.randn(2, 8)
        CountingConfig.reads = 0
        cap = stampout.capture(model, x)
        reads.append(CountingConfig.reads)
        assert (cap.stats.traces, cap.stats.reuses) == (1, n - 1)
        torch.testing.assert_close(cap(x), model(x))
    assert reads[1] == reads[0], reads


_LOGGER = logging.getLogger("stampout_test_stamp_cost_walks")


class LoggingLayer(nn.Module):
    """Reads its module's logger, as a Hugging Face layer does (`logger.warning_once`), and with `keep`, stores the
    traced result on it."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if _LOGGER.disabled:
            out = out + 1
        if self.keep:
            _LOGGER.__dict__["last"] = out  # (behind any __setattr__)
        return out


def test_the_walk_for_fakes_opens_a_logger_the_program_reads_but_not_the_logging_registry(monkeypatch) -> None:
    """A logger the program reads is opened by the walk for what the program left behind; the process's logger
    registry it points to (`logging.Manager`: every logger by name, ~400 of them under transformers, ~1.7 ms a
    capture) is left shut, as the import system is. A traced value stored on the logger itself is still found (and
    made real, as eager leaves it)."""
    others = [logging.getLogger(f"stampout_test_walks.{i}") for i in range(20)]  # (in the registry only)
    model = RegionStack([LoggingLayer(), LoggingLayer()])
    x = torch.randn(2, 8)
    opened = count_opened(monkeypatch, id)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)
    assert opened[id(_LOGGER)] >= 1 and opened[id(_LOGGER.manager.loggerDict)] == 0
    assert not any(opened[id(other)] for other in others)
    torch.testing.assert_close(cap(x), model(x))
    keeping = LoggingLayer(keep=True)
    try:
        out = stampout.capture(keeping, x)(x)
        assert type(_LOGGER.last) is torch.Tensor
        torch.testing.assert_close(_LOGGER.last, out)
    finally:
        _LOGGER.__dict__.pop("last", None)


def test_a_capture_compares_only_the_submodule_registries_after_the_run(monkeypatch) -> None:
    """What a capture asks of the registries after the run is which modules the program made (registered in a
    `_modules`): the parameter and buffer dicts, two of a module's three, are not compared (compile's plan, which
    replays their changes, compares them all)."""
    effects = importlib.import_module("stampout.capture.effects")
    model = Stack(4)
    kinds = {id(m.__dict__[name]): name for m in model.modules() for name in ("_parameters", "_buffers", "_modules")}
    compared: collections.Counter = collections.Counter()
    same = effects._same_registry
    monkeypatch.setattr(effects, "_same_registry", lambda d, old: compared.update([kinds.get(id(d))]) or same(d, old))
    x = torch.randn(2, 8)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3)
    torch.testing.assert_close(cap(x), model(x))
    assert compared["_modules"] == len(list(model.modules())) and set(compared) == {"_modules"}, compared


def test_the_world_repair_does_not_open_a_module_the_left_over_pass_found_clean(monkeypatch) -> None:
    """The world repair after a capture (clear_fakes) skips each module the left-over pass's whole walk went through
    without finding a traced value (nothing since stored one): it lists no module's attributes again. A module that
    holds one is still opened and put right (test_world_restored)."""
    program = importlib.import_module("stampout.capture.program")
    world = importlib.import_module("stampout.watch.world")
    opened = []
    repairing = []
    restore, public = program.restore_world, world.public_names
    monkeypatch.setattr(program, "restore_world", lambda *a, **k: repairing.append(1) or restore(*a, **k))
    monkeypatch.setattr(world, "public_names", lambda keys: (repairing and opened.append(keys)) or public(keys))
    model = Stack(4)
    x = torch.randn(2, 8)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3) and repairing
    torch.testing.assert_close(cap(x), model(x))
    assert not opened, len(opened)
