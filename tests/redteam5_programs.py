# ruff: noqa: B006, B019, B023, B028, E731, E741 (the programs are written as users write them)
"""Red-team round 5: ordinary programs that touch the world from traced code, for tests/test_redteam5.py: a module
global added after capture that shadows a builtin, defaultdict inputs and their default_factory, ModuleList's own
`__iter__` patched, containers of the call's returned, NumPy arrays and byte buffers changed in place between calls,
torch Generators reseeded, weakref proxies, C helpers (`operator.attrgetter`), ChainMap and Fraction inputs,
autograd Functions whose backward reads state, one-shot hooks, tensor facts (views, leaves, versions, `.grad`)
branched on, library classes patched. Same shape as tests/redteam3_programs.py: each `make(wrap)` builds a fresh world
(`wrap` is the identity for eager, or compiles) and returns `run(i)`: call i, with the changes a user makes between
calls, returning what is compared with eager."""

from __future__ import annotations

import array
import collections
import dataclasses
import fractions
import inspect
import operator
import weakref

import numpy as np
import torch
from redteam_battery import grads, inp, lin, registry
from torch import nn

PROGRAMS, program = registry()


# ---- module globals and builtins ------------------------------------------------------------------------------------


def _rt5_mag(t):
    return abs(t) + 1.0


@program
def global_shadows_builtin_later(wrap):
    """A helper calls `abs`; between calls the module gains a global `abs` (a patched version), later deleted."""
    l = lin()

    def fwd(x):
        return _rt5_mag(l(x))

    f = wrap(fwd)

    def run(i):
        if i == 2:
            globals()["abs"] = lambda t: t * 2.0
        if i == 4:
            del globals()["abs"]
        return [f(inp(i))]

    return run


# ---- containers -----------------------------------------------------------------------------------------------------


@program
def defaultdict_input_factory(wrap):
    """A defaultdict of tensors passed in; forward reads a missing key (the factory runs and stores); the caller
    changes the factory between calls."""
    l = lin()

    def fwd(x, d):
        return l(x) + d["bias"]

    f = wrap(fwd)
    factory = [lambda: torch.zeros(4)]

    def run(i):
        if i == 2:
            factory[0] = lambda: torch.ones(4) * 3
        d = collections.defaultdict(factory[0])
        if i == 3:
            d["bias"] = torch.full((4,), 7.0)
        out = f(inp(i), d)
        return [out, sorted(d), d["bias"]]

    return run


@program
def defaultdict_held_factory_swapped(wrap):
    """A defaultdict held by the module (counters by name); the caller swaps its default_factory between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.gains = collections.defaultdict(lambda: 1.0)

        def forward(s, x):
            return s.l(x) * s.gains["main"]

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.gains.default_factory = lambda: 4.0
        if i == 3:
            m.gains.clear()
        with torch.no_grad():
            return [f(inp(i)), dict(m.gains)]

    return run


@program
def module_list_iter_patched(wrap):
    """nn.ModuleList.__iter__ itself patched between calls (walks in reverse), then put back."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(lin(i) for i in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) * 0.5
            return x

    f = wrap(Model())
    original = nn.ModuleList.__iter__

    def run(i):
        try:
            if i in (2, 3):
                nn.ModuleList.__iter__ = lambda self: iter(list(self._modules.values())[::-1])
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.ModuleList.__iter__ = original

    return run


@program
def returns_input_dict(wrap):
    """forward writes its result into the batch dict it was given and returns that dict."""
    l = lin()

    def fwd(batch):
        batch["y"] = l(batch["x"])
        return batch

    f = wrap(fwd)

    def run(i):
        batch = {"x": inp(i)}
        out = f(batch)
        return [out is batch, sorted(batch), batch["y"]]

    return run


@program
def returns_list_inside_input_dict(wrap):
    """forward appends to a list held by the batch dict it was given and returns that list."""
    l = lin()

    def fwd(batch):
        batch["hs"].append(l(batch["hs"][-1]))
        return batch["hs"]

    f = wrap(fwd)

    def run(i):
        hs = [inp(i)]
        out = f({"hs": hs})
        return [out is hs, len(hs), hs[-1]]

    return run


@program
def returns_input_list_unchanged(wrap):
    """forward returns the list it was given, untouched, beside a tensor."""
    l = lin()

    def fwd(xs):
        return l(xs[0]), xs

    f = wrap(fwd)

    def run(i):
        xs = [inp(i)]
        y, back = f(xs)
        back.append(1)
        return [y, back is xs, len(xs)]

    return run


@program
def set_of_modules_held(wrap):
    """The model keeps a plain set of extra modules (not registered); the caller adds one between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.extras = {nn.Identity()}

        def forward(s, x):
            y = s.l(x)
            return y * len(s.extras)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.extras.add(nn.Tanh())
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- NumPy arrays and buffers changed in place ------------------------------------------------------------------------


@program
def numpy_table_from_numpy(wrap):
    """A NumPy table held by the module, read with torch.from_numpy; the caller writes one of its items."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.table = np.ones(4, dtype=np.float32)

        def forward(s, x):
            return s.l(x) * torch.from_numpy(s.table)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.table[1] = 5.0
        if i == 3:
            m.table *= 2
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def numpy_table_as_tensor(wrap):
    """A NumPy table read with torch.as_tensor / torch.tensor (copies); the caller writes it in place."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.table = np.ones(4, dtype=np.float32)

        def forward(s, x):
            return s.l(x) * torch.tensor(s.table) + torch.as_tensor(s.table)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.table[0] = -3.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def numpy_scalar_in_array(wrap):
    """A float taken out of a NumPy array held by a global config; the caller writes the array."""
    cfg = {"gain": np.array([1.0, 2.0])}
    l = lin()

    def fwd(x):
        return l(x) * float(cfg["gain"][1])

    f = wrap(fwd)

    def run(i):
        if i == 2:
            cfg["gain"][1] = 0.5
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def bytearray_frombuffer(wrap):
    """A bytearray of the module's read as a tensor with torch.frombuffer; the caller writes a byte."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.raw = bytearray(4)

        def forward(s, x):
            mask = torch.frombuffer(s.raw, dtype=torch.uint8).float()
            return s.l(x) + mask

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.raw[2] = 9
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def python_array_as_tensor(wrap):
    """An array.array of scales turned into a tensor; the caller writes an item."""
    scales = array.array("f", [1.0, 1.0, 1.0, 1.0])
    l = lin()

    def fwd(x):
        return l(x) * torch.tensor(scales)

    f = wrap(fwd)

    def run(i):
        if i == 2:
            scales[3] = 4.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- RNG objects ----------------------------------------------------------------------------------------------------


@program
def torch_generator_on_module(wrap):
    """A torch.Generator held by the module draws noise each call; the caller reseeds it between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.gen = torch.Generator().manual_seed(1)

        def forward(s, x):
            return s.l(x) + torch.rand(x.shape, generator=s.gen)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.gen.manual_seed(7)
        with torch.no_grad():
            return [f(inp(i)), m.gen.initial_seed(), torch.rand(2, generator=m.gen)]

    return run


@program
def torch_generator_argument(wrap):
    """A torch.Generator passed per call (fresh or reused)."""
    l = lin()

    def fwd(x, g):
        return l(x) * torch.randn(x.shape, generator=g)

    f = wrap(fwd)
    g0 = torch.Generator().manual_seed(3)

    def run(i):
        g = g0 if i % 2 else torch.Generator().manual_seed(i)
        with torch.no_grad():
            return [f(inp(i), g), torch.rand(1, generator=g)]

    return run


@program
def fork_rng_in_forward(wrap):
    """forward draws noise inside torch.random.fork_rng (the global stream is left as it was)."""
    l = lin()

    def fwd(x):
        with torch.random.fork_rng():
            torch.manual_seed(5)
            n = torch.randn(x.shape)
        return l(x) + n

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            return [f(inp(i)), torch.rand(2)]

    return run


# ---- objects reached in odd ways -------------------------------------------------------------------------------------


class _Owner:
    def __init__(self):
        self.scale = 1.0


@program
def weakref_proxy_owner(wrap):
    """The module reaches its owner's scale through a weakref.proxy; the caller changes the scale."""
    owner = _Owner()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.owner = weakref.proxy(owner)

        def forward(s, x):
            return s.l(x) * s.owner.scale

    f = wrap(M())

    def run(i):
        if i == 2:
            owner.scale = 3.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def attrgetter_config(wrap):
    """A scale read with operator.attrgetter('cfg.scale') (a C callable); the caller changes it."""
    get = operator.attrgetter("cfg.scale")

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cfg = _Owner()

        def forward(s, x):
            return s.l(x) * get(s)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.cfg.scale = 5.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def itemgetter_table(wrap):
    """Two gains read with operator.itemgetter from a dict the caller updates."""
    get = operator.itemgetter("a", "b")
    table = {"a": 1.0, "b": 2.0}
    l = lin()

    def fwd(x):
        a, b = get(table)
        return l(x) * a + b

    f = wrap(fwd)

    def run(i):
        if i == 2:
            table["b"] = -1.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def chainmap_config_input(wrap):
    """A ChainMap of overrides over defaults passed in; the caller edits the overrides between calls."""
    defaults = {"scale": 1.0, "shift": 0.0}
    overrides = {}
    l = lin()

    def fwd(x, cfg):
        return l(x) * cfg["scale"] + cfg["shift"]

    f = wrap(fwd)
    cfg = collections.ChainMap(overrides, defaults)

    def run(i):
        if i == 2:
            overrides["scale"] = 2.0
        if i == 3:
            defaults["shift"] = 1.0
        with torch.no_grad():
            return [f(inp(i), cfg)]

    return run


@program
def fraction_argument(wrap):
    """A Fraction passed as the gain."""
    l = lin()

    def fwd(x, q):
        return l(x) * float(q)

    f = wrap(fwd)

    def run(i):
        q = fractions.Fraction(1, [2, 2, 3, 4, 2][i])
        with torch.no_grad():
            return [f(inp(i), q)]

    return run


@program
def complex_argument(wrap):
    """A complex number passed; its real part scales."""
    l = lin()

    def fwd(x, c):
        return l(x) * c.real + c.imag

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            return [f(inp(i), [1 + 0j, 1 + 0j, 2 + 1j, 1 + 0j, 1.0][i])]

    return run


@dataclasses.dataclass
class _Cfg:
    scale: float = 1.0
    shift: float = 0.0


@program
def vars_of_config(wrap):
    """forward sums `vars(cfg)` of a dataclass config the caller edits."""
    cfg = _Cfg()
    l = lin()

    def fwd(x):
        return l(x) + sum(vars(cfg).values())

    f = wrap(fwd)

    def run(i):
        if i == 2:
            cfg.shift = 3.0
        if i == 3:
            cfg.extra = 10.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def dataclass_replace_and_asdict(wrap):
    """forward makes a variant of its config with dataclasses.replace and reads asdict of it."""
    cfg = _Cfg()
    l = lin()

    def fwd(x):
        c = dataclasses.replace(cfg, shift=cfg.shift + 1)
        d = dataclasses.asdict(c)
        return l(x) * d["scale"] + d["shift"]

    f = wrap(fwd)

    def run(i):
        if i == 2:
            cfg.scale = 2.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def signature_decides_kwargs(wrap):
    """A block passes `scale=` only to layers whose forward accepts it (inspect.signature); the caller swaps a layer's
    forward for one that does."""

    class Plain(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = Plain()

        def forward(s, x):
            if "scale" in inspect.signature(s.a.forward).parameters:
                return s.a(x, scale=3.0)
            return s.a(x)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.a.forward = lambda x, scale=1.0: m.a.l(x) * scale
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- tensor facts branched on -----------------------------------------------------------------------------------------


@program
def branch_on_is_view(wrap):
    """forward copies its input when it is a view (x._base is not None)."""
    l = lin()

    def fwd(x):
        if x._base is not None:
            x = x * 10
        return l(x)

    f = wrap(fwd)

    def run(i):
        x = inp(i, n=4)
        x = x[:2] if i in (2, 3) else x[:2].clone()
        with torch.no_grad():
            return [f(x)]

    return run


@program
def branch_on_is_leaf(wrap):
    """forward treats a non-leaf input (one that came from a computation) differently."""
    l = lin()

    def fwd(x):
        y = l(x)
        return y * 2 if x.is_leaf else y

    f = wrap(fwd)
    w = torch.ones(4, requires_grad=True)

    def run(i):
        x = inp(i)
        if i in (2, 4):
            x = x * w
        y = f(x)
        y.sum().backward()
        return [y.detach(), w.grad.clone() if w.grad is not None else None]

    return run


@program
def branch_on_version(wrap):
    """forward reads the input's version counter (a cache key of the user's)."""
    l = lin()

    def fwd(x):
        return l(x) + x._version

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        for _ in range(i):
            x.add_(0.0)
        with torch.no_grad():
            return [f(x)]

    return run


@program
def branch_on_grad_present(wrap):
    """forward reads whether the weight has a gradient yet (a warm-up switch)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            if s.l.weight.grad is None:
                return y * 0.1
            return y + s.l.weight.grad.sum()

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), grads(m)]

    return run


@program
def branch_on_storage_offset(wrap):
    """forward shifts when its input does not start its storage."""
    l = lin()

    def fwd(x):
        return l(x) + x.storage_offset()

    f = wrap(fwd)

    def run(i):
        big = inp(i, n=4)
        x = big[1:3] if i in (2, 3) else big[0:2]
        with torch.no_grad():
            return [f(x)]

    return run


# ---- autograd ------------------------------------------------------------------------------------------------------


_RT5_LAMBDA = 1.0


class _ReverseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -_RT5_LAMBDA * g


@program
def grad_reversal_global_lambda(wrap):
    """A gradient-reversal Function whose backward reads a module global the caller changes between calls."""
    l1, l2 = lin(0), lin(1)

    def fwd(x):
        return l2(_ReverseGrad.apply(l1(x)))

    f = wrap(fwd)

    def run(i):
        global _RT5_LAMBDA
        _RT5_LAMBDA = [1.0, 1.0, 0.5, 2.0, 1.0][i]
        for p in (*l1.parameters(), *l2.parameters()):
            p.grad = None
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), grads(l1)]

    return run


class _ScaleGradByOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.owner.grad_scale, None


@program
def grad_scale_read_in_backward(wrap):
    """A Function stores its module on ctx; backward reads the module's grad_scale (forward never does)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.grad_scale = 1.0

        def forward(s, x):
            return _ScaleGradByOwner.apply(s.l(x), s)

    m = M()
    f = wrap(m)

    def run(i):
        m.grad_scale = [1.0, 1.0, 3.0, 3.0, 0.5][i]
        m.zero_grad()
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), grads(m)]

    return run


@program
def one_shot_pre_hook(wrap):
    """A forward pre-hook that removes itself on its first call (a lazy initialiser), counting its runs."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.ran = 0
            s.handle = s.register_forward_pre_hook(s._init)

        def _init(s, mod, args):
            s.ran += 1
            with torch.no_grad():
                s.l.bias.fill_(0.5)
            s.handle.remove()

        def forward(s, x):
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i)), m.ran, m.l.bias.clone()]

    return run


@program
def multi_grad_hook(wrap):
    """torch.autograd.graph.register_multi_grad_hook on two outputs, registered inside forward, counting."""
    l1, l2 = lin(0), lin(1)
    seen = []

    def fwd(x):
        a, b = l1(x), l2(x)
        torch.autograd.graph.register_multi_grad_hook((a, b), lambda gs: seen.append(len(gs)))
        return a + b

    f = wrap(fwd)

    def run(i):
        y = f(inp(i, grad=True))
        y.sum().backward()
        return [y.detach(), list(seen), grads(l1)]

    return run


@program
def forward_ad_dual_input(wrap):
    """The compiled model called on a forward-AD dual tensor (a JVP): the tangent of the output."""
    import torch.autograd.forward_ad as fwAD

    l = lin()

    def fwd(x):
        return torch.tanh(l(x))

    f = wrap(fwd)

    def run(i):
        with torch.no_grad(), fwAD.dual_level():
            x = fwAD.make_dual(inp(i), torch.ones(2, 4))
            out = fwAD.unpack_dual(f(x))
            return [out.primal.clone(), None if out.tangent is None else out.tangent.clone()]

    return run


@program
def func_grad_around_compiled(wrap):
    """torch.func.grad of a loss that calls the compiled function."""
    l = lin()

    def fwd(x):
        return torch.tanh(l(x)).sum()

    f = wrap(fwd)

    def run(i):
        return [torch.func.grad(f)(inp(i))]

    return run


@program
def vmap_around_compiled(wrap):
    """torch.vmap over the compiled function."""
    l = lin()

    def fwd(x):
        return torch.tanh(l(x)) * x.shape[-1]

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            return [torch.vmap(f)(inp(i, n=3).unsqueeze(1))]

    return run


# ---- library classes patched --------------------------------------------------------------------------------------


@program
def linear_forward_patched(wrap):
    """nn.Linear.forward patched for calls 2-3 (a LoRA-style injection), then put back."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = lin(0), lin(1)

        def forward(s, x):
            return s.b(torch.relu(s.a(x)))

    f = wrap(M())
    original = nn.Linear.forward

    def run(i):
        try:
            if i in (2, 3):
                nn.Linear.forward = lambda self, x: original(self, x) * 2
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.Linear.forward = original

    return run


@program
def module_call_patched(wrap):
    """nn.Module.__call__ wrapped for call 2 (instrumentation that counts calls), then put back."""
    m = nn.Sequential(lin(0), nn.ReLU(), lin(1))
    f = wrap(m)
    original = nn.Module.__call__
    count = [0]

    def counting(self, *a, **k):
        count[0] += 1
        return original(self, *a, **k)

    def run(i):
        try:
            if i == 2:
                nn.Module.__call__ = counting
            with torch.no_grad():
                return [f(inp(i)), count[0], nn.Module.__call__ is counting]
        finally:
            nn.Module.__call__ = original

    return run


@program
def torch_function_attribute_patched(wrap):
    """torch.tanh replaced in the torch namespace for call 2 (an experiment), then put back."""
    l = lin()

    def fwd(x):
        return torch.tanh(l(x))

    f = wrap(fwd)
    original = torch.tanh

    def run(i):
        try:
            if i == 2:
                torch.tanh = lambda t: t * 0.0
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            torch.tanh = original

    return run


# ---- dispatch tables, registries and config classes ---------------------------------------------------------------


@program
def singledispatch_gain(wrap):
    """A functools.singledispatch helper turns the config's `gain` into a float; between calls the caller registers
    a handler for str gains and passes one."""
    import functools

    @functools.singledispatch
    def as_gain(g):
        return 1.0

    @as_gain.register
    def _(g: float):
        return g

    class Cfg:
        gain = 2.0

    l = lin()

    def fwd(x):
        return l(x) * as_gain(Cfg.gain)

    f = wrap(fwd)

    def run(i):
        if i == 2:
            as_gain.register(int, lambda g: float(g) * 10)
        if i == 3:
            Cfg.gain = 3
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def config_attribute_map(wrap):
    """A config whose __getattribute__ maps aliases through a class-level table (as Hugging Face's configs do); the
    caller changes the table between calls."""

    class Cfg:
        attribute_map = {"scale": "gain"}

        def __init__(self):
            self.gain = 2.0
            self.shift = 0.5

        def __getattribute__(self, name):
            if name != "attribute_map" and name in type(self).attribute_map:
                name = type(self).attribute_map[name]
            return super().__getattribute__(name)

    cfg = Cfg()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cfg = cfg

        def forward(s, x):
            return s.l(x) * s.cfg.scale

    f = wrap(M())

    def run(i):
        if i == 2:
            Cfg.attribute_map["scale"] = "shift"
        with torch.no_grad():
            return [f(inp(i))]

    return run


_RT5_EVAL_SCALE = 1.0


@program
def eval_expression_in_forward(wrap):
    """forward evaluates a user-given expression string (reading a module global) with eval."""
    l = lin()
    expr = ["_RT5_EVAL_SCALE * 2"]

    def fwd(x):
        return l(x) * eval(expr[0])

    f = wrap(fwd)

    def run(i):
        global _RT5_EVAL_SCALE
        if i == 2:
            _RT5_EVAL_SCALE = 3.0
        if i == 3:
            expr[0] = "_RT5_EVAL_SCALE + 1"
        if i == 4:
            _RT5_EVAL_SCALE = 1.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def matmul_precision_branch(wrap):
    """forward reads torch.get_float32_matmul_precision() to pick a path; the caller sets it between calls."""
    l = lin()

    def fwd(x):
        y = l(x)
        return y * 2 if torch.get_float32_matmul_precision() == "highest" else y

    f = wrap(fwd)

    def run(i):
        try:
            if i in (2, 3):
                torch.set_float32_matmul_precision("high")
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            torch.set_float32_matmul_precision("highest")

    return run


_RT5_CALLBACKS = []


@program
def global_callback_list(wrap):
    """forward runs every callback of a module-global list on its output; the caller appends one between calls."""
    l = lin()

    def fwd(x):
        y = l(x)
        for cb in _RT5_CALLBACKS:
            y = cb(y)
        return y

    f = wrap(fwd)

    def run(i):
        if i == 0:
            _RT5_CALLBACKS.clear()
        if i == 2:
            _RT5_CALLBACKS.append(lambda t: t * 3)
        if i == 4:
            _RT5_CALLBACKS.clear()
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def class_registry_of_plugins(wrap):
    """The model class keeps a class-level list of plugin modules (not registered); the caller adds one."""

    class M(nn.Module):
        plugins = []

        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            for p in type(s).plugins:
                y = p(y)
            return y

    f = wrap(M())

    def run(i):
        if i == 2:
            M.plugins.append(nn.Tanh())
        with torch.no_grad():
            return [f(inp(i))]

    return run


class _Tagged(torch.Tensor):
    gain = 1.0


@program
def tensor_subclass_class_attribute(wrap):
    """A tensor subclass input whose class attribute scales the output; the caller changes the class attribute."""
    l = lin()

    def fwd(x):
        return l(x.as_subclass(torch.Tensor)) * type(x).gain + x.gain

    f = wrap(fwd)

    def run(i):
        if i == 2:
            _Tagged.gain = 4.0
        if i == 4:
            _Tagged.gain = 1.0
        with torch.no_grad():
            return [f(inp(i).as_subclass(_Tagged)).as_subclass(torch.Tensor)]

    return run


@program
def parameter_list_getitem_patched(wrap):
    """nn.ParameterList indexed in forward; nn.ParameterList.__getitem__ patched for a call, then put back."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ps = nn.ParameterList([nn.Parameter(torch.ones(4)), nn.Parameter(torch.full((4,), 2.0))])

        def forward(s, x):
            return x * s.ps[0] + s.ps[1]

    f = wrap(M())
    original = nn.ParameterList.__getitem__

    def run(i):
        try:
            if i == 2:
                nn.ParameterList.__getitem__ = lambda self, idx: original(self, 1 - idx)
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.ParameterList.__getitem__ = original

    return run


@program
def module_dict_getitem_patched(wrap):
    """nn.ModuleDict indexed by name in forward; nn.ModuleDict.__getitem__ patched for a call (aliases), then put
    back."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.heads = nn.ModuleDict({"a": lin(0), "b": lin(1)})

        def forward(s, x):
            return s.heads["a"](x)

    f = wrap(M())
    original = nn.ModuleDict.__getitem__

    def run(i):
        try:
            if i == 2:
                nn.ModuleDict.__getitem__ = lambda self, k: original(self, "b" if k == "a" else k)
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.ModuleDict.__getitem__ = original

    return run


@program
def global_backward_hook_between_calls(wrap):
    """A global full backward hook (register_module_full_backward_hook) that scales grad_input, for calls 2-3."""
    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    f = wrap(m)
    seen = []

    def hook(mod, gin, gout):
        seen.append(type(mod).__name__)
        return tuple(None if g is None else g * 2 for g in gin)

    def run(i):
        handle = nn.modules.module.register_module_full_backward_hook(hook) if i in (2, 3) else None
        try:
            m.zero_grad()
            y = f(inp(i, grad=True))
            y.sum().backward()
            return [y.detach(), grads(m), list(seen)]
        finally:
            if handle is not None:
                handle.remove()

    return run


@program
def forward_pre_hook_with_kwargs(wrap):
    """A forward pre-hook with_kwargs that rewrites a keyword, registered between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x, scale=1.0):
            return s.l(x) * scale

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.register_forward_pre_hook(lambda mod, a, k: (a, {**k, "scale": 5.0}), with_kwargs=True)
        with torch.no_grad():
            return [f(inp(i), scale=2.0)]

    return run


@program
def complex_conj_input(wrap):
    """A complex input, passed conjugated (lazy conj bit) on some calls."""
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.complex64)

    def fwd(x):
        return (x @ w).abs()

    f = wrap(fwd)

    def run(i):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i), dtype=torch.complex64)
        if i in (2, 3):
            x = x.conj()
        return [f(x)]

    return run


@program
def methodcaller_on_layers(wrap):
    """forward applies operator.methodcaller('forward') to each layer (a C callable)."""
    call = operator.methodcaller("forward", None)

    class Layer(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.l = lin(i)
            s.x = None

        def forward(s, _):
            return s.l(s.x)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = Layer(0)

        def forward(s, x):
            s.a.x = x
            return call(s.a)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.a.l = lin(5)
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def keys_view_held(wrap):
    """The model keeps a keys() view of a table of gains, iterated in forward; the caller adds a key to the table."""
    table = {"a": 1.0}

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.names = table.keys()

        def forward(s, x):
            return s.l(x) * len(s.names) + sum(table[k] for k in s.names)

    f = wrap(M())

    def run(i):
        if i == 2:
            table["b"] = 5.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def wrapped_forward_counter(wrap):
    """forward decorated with a functools.wraps decorator of the user's that counts calls in its closure."""
    import functools

    def counted(fn):
        n = [0]

        @functools.wraps(fn)
        def inner(*a, **k):
            n[0] += 1
            return fn(*a, **k) * n[0]

        inner.n = n
        return inner

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        @counted
        def forward(s, x):
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i)), M.forward.n[0]]

    return run


@program
def sequential_getitem_slice(wrap):
    """forward runs a slice of a Sequential chosen by a depth attribute the caller changes."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.body = nn.Sequential(lin(0), nn.Tanh(), lin(1), nn.Tanh())
            s.depth = 2

        def forward(s, x):
            return s.body[: s.depth](x)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.depth = 4
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- outputs that alias inputs and state ---------------------------------------------------------------------------


@program
def output_view_of_input_written(wrap):
    """forward returns a view of its input beside a result; the caller writes the view in place."""
    l = lin()

    def fwd(x):
        return l(x), x[0], x.t()

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        with torch.no_grad():
            y, row, xt = f(x)
            row.add_(100)
            xt[1, 1] = -7
        return [y, x, row._base is x, xt._base is x]

    return run


@program
def output_is_input(wrap):
    """forward returns its input unchanged beside a result (a pass-through)."""
    l = lin()

    def fwd(x, h):
        return l(x), h

    f = wrap(fwd)

    def run(i):
        x, h = inp(i), inp(i + 10)
        with torch.no_grad():
            y, back = f(x, h)
            same = back is h
            back.mul_(2)
        return [y, same, h]

    return run


@program
def output_is_parameter(wrap):
    """forward returns a parameter itself and a view of a buffer; the caller writes them in place."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.register_buffer("steps", torch.zeros(4))

        def forward(s, x):
            return s.l(x), s.l.bias, s.steps.view(2, 2)

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            y, b, st = f(inp(i))
            same = b is m.l.bias
            b.add_(1)
            st.add_(1)
        return [y, same, m.l.bias.clone(), m.steps.clone()]

    return run


@program
def output_stored_on_module(wrap):
    """forward keeps its output on the module (`self.last = y`) and returns it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.last = None

        def forward(s, x):
            y = s.l(x)
            s.last = y
            return y

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            y = f(inp(i))
            same = y is m.last
            y.add_(1)
        return [same, m.last.clone()]

    return run


@program
def nested_compiled_inner(wrap):
    """A compiled submodule called by an outer compiled function; the inner module's scale changes between calls."""

    class Inner(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scale = 1.0

        def forward(s, x):
            return s.l(x) * s.scale

    inner = Inner()
    g = wrap(inner)

    def fwd(x):
        return g(x).tanh()

    f = wrap(fwd)

    def run(i):
        if i == 2:
            inner.scale = 3.0
        with torch.no_grad():
            return [f(inp(i)), g(inp(i + 1))]

    return run


@program
def checkpoint_around_compiled(wrap):
    """The caller wraps the compiled model in torch.utils.checkpoint (non-reentrant) in training."""
    import torch.utils.checkpoint as cp

    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    f = wrap(m)

    def run(i):
        m.zero_grad()
        y = cp.checkpoint(f, inp(i, grad=True), use_reentrant=False)
        y.sum().backward()
        return [y.detach(), grads(m)]

    return run


@program
def backward_twice_retain_graph(wrap):
    """The caller runs backward twice on one output (retain_graph), accumulating gradients."""
    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    f = wrap(m)

    def run(i):
        m.zero_grad()
        y = f(inp(i))
        y.sum().backward(retain_graph=True)
        (y * 2).sum().backward()
        return [y.detach(), grads(m)]

    return run


@program
def module_call_impl_patched(wrap):
    """nn.Module._call_impl patched for calls 2-3 (a profiler's wrapper that scales what every module returns), then
    put back."""
    m = nn.Sequential(lin(0), nn.ReLU(), lin(1))
    f = wrap(m)
    original = nn.Module._call_impl

    def scaled(self, *a, **k):
        out = original(self, *a, **k)
        return out * 2 if isinstance(self, nn.Linear) else out

    def run(i):
        try:
            if i in (2, 3):
                nn.Module._call_impl = scaled
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.Module._call_impl = original

    return run


@program
def module_getattr_patched(wrap):
    """nn.Module.__getattr__ patched for call 2 (aliases a submodule name), then put back."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = lin(0), lin(1)

        def forward(s, x):
            return s.a(x)

    f = wrap(M())
    original = nn.Module.__getattr__

    def run(i):
        try:
            if i == 2:
                nn.Module.__getattr__ = lambda self, name: original(self, "b" if name == "a" else name)
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.Module.__getattr__ = original

    return run


# ---- C functions that change what they are given ------------------------------------------------------------------


@program
def thread_started_in_forward(wrap):
    """forward hands a statistic to a background thread per call (an async logger) and waits for it."""
    import threading

    l = lin()
    log = []

    def record(v):
        log.append(v)

    def fwd(x):
        y = l(x)
        t = threading.Thread(target=record, args=(tuple(y.shape),))
        t.start()
        t.join()
        return y

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            return [f(inp(i)), list(log)]

    return run


@program
def heapq_held_queue(wrap):
    """forward pushes the batch size onto a heap the model keeps (heapq, C), and scales by the smallest."""
    import heapq

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.heap = [5]

        def forward(s, x):
            heapq.heappush(s.heap, x.shape[0])
            return s.l(x) * s.heap[0]

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i, n=[3, 2, 4, 2, 1][i])), list(m.heap)]

    return run


@program
def bisect_insort_held(wrap):
    """forward inserts the batch size into a sorted list the model keeps (bisect.insort, C) and reads its median."""
    import bisect

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.sizes = []

        def forward(s, x):
            bisect.insort(s.sizes, x.shape[0])
            return s.l(x) * s.sizes[len(s.sizes) // 2]

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i, n=[3, 2, 4, 2, 1][i])), list(m.sizes)]

    return run


@program
def operator_setitem_held(wrap):
    """forward counts calls in a held dict through operator.setitem and operator.iadd (C)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.stats = {"calls": 0}
            s.seen = []

        def forward(s, x):
            operator.setitem(s.stats, "calls", s.stats["calls"] + 1)
            operator.iadd(s.seen, [x.shape[0]])
            return s.l(x) * s.stats["calls"]

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i)), dict(m.stats), list(m.seen)]

    return run


@program
def list_sort_held_in_place(wrap):
    """forward appends to a held list and sorts it in place (reverse), reading its head."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.vals = [1.0]

        def forward(s, x):
            s.vals.append(float(x.shape[0]))
            s.vals.sort(reverse=True)
            return s.l(x) * s.vals[0]

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            return [f(inp(i, n=[3, 2, 4, 2, 1][i])), list(m.vals)]

    return run


@program
def gc_disabled_in_forward(wrap):
    """forward turns Python's garbage collector off (a speed trick); the caller turns it back on between calls."""
    import gc

    l = lin()

    def fwd(x):
        gc.disable()
        return l(x)

    f = wrap(fwd)

    def run(i):
        try:
            with torch.no_grad():
                y = f(inp(i))
            return [y, gc.isenabled()]
        finally:
            gc.enable()

    return run


_RT5_CLIP = 1.0


class _ClipToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-_RT5_CLIP, _RT5_CLIP)

    @staticmethod
    def backward(ctx, g):
        return g


@program
def function_forward_reads_global(wrap):
    """A custom autograd.Function whose forward reads a module global the caller changes (inference)."""
    l = lin()

    def fwd(x):
        return _ClipToGlobal.apply(l(x))

    f = wrap(fwd)

    def run(i):
        global _RT5_CLIP
        _RT5_CLIP = [1.0, 1.0, 0.25, 0.25, 2.0][i]
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def forward_hook_bound_method_state(wrap):
    """A child's forward hook is a bound method of a scaler object whose scale the caller changes."""

    class Scaler:
        def __init__(self):
            self.scale = 1.0
            self.calls = 0

        def hook(self, mod, args, out):
            self.calls += 1
            return out * self.scale

    scaler = Scaler()
    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    m[0].register_forward_hook(scaler.hook)
    f = wrap(m)

    def run(i):
        if i == 2:
            scaler.scale = 3.0
        with torch.no_grad():
            return [f(inp(i)), scaler.calls]

    return run


@program
def buffer_updated_in_forward_aot(wrap):
    """A running mean buffer updated in place in forward under no_grad (training stats), read by the caller."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.register_buffer("mean", torch.zeros(4))
            s.momentum = 0.5

        def forward(s, x):
            y = s.l(x)
            with torch.no_grad():
                s.mean.mul_(1 - s.momentum).add_(y.mean(0) * s.momentum)
            return y - s.mean

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.momentum = 0.1
        m.zero_grad()
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), m.mean.clone(), grads(m)]

    return run


@program
def hook_objects_between_calls(wrap):
    """A callable-object pre-hook on the root and a functools.partial forward hook on a child, added between calls,
    each reading and counting state of the user's."""
    import functools

    class Shift:
        def __init__(self):
            self.by = 0.5
            self.n = 0

        def __call__(self, mod, args):
            self.n += 1
            return (args[0] + self.by,)

    def gain(table, mod, args, out):
        table["n"] += 1
        return out * table["g"]

    shift, table = Shift(), {"g": 2.0, "n": 0}
    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    f = wrap(m)

    def run(i):
        if i == 1:
            m.register_forward_pre_hook(shift)
        if i == 2:
            m[2].register_forward_hook(functools.partial(gain, table))
        if i == 3:
            shift.by, table["g"] = -1.0, 0.5
        with torch.no_grad():
            return [f(inp(i)), shift.n, dict(table)]

    return run


@program
def sizes_logged_under_dynamic(wrap):
    """forward logs each batch size to a held list and a dict keyed by size, and stores the last one, while the
    sizes change (dynamic capture)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.sizes = []
            s.by_size = {}
            s.last = None

        def forward(s, x):
            n = x.shape[0]
            s.sizes.append(n)
            s.by_size[n] = s.by_size.get(n, 0) + 1
            s.last = (n, n * 2)
            return s.l(x) * len(s.sizes)

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            y = f(inp(i, n=[2, 3, 5, 3, 7][i]))
        return [y, list(m.sizes), [type(v).__name__ for v in m.sizes], dict(m.by_size), m.last]

    return run


@program
def rg_call_impl_patched(wrap):
    """Repeated layers (regions="auto") while nn.Module._call_impl is wrapped for calls 2-3 (each Linear's output
    doubled), then put back."""

    class Block(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.l = lin(i)

        def forward(s, x):
            return torch.tanh(s.l(x))

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(Block(i) for i in range(3))

        def forward(s, x):
            for layer in s.layers:
                x = layer(x)
            return x

    f = wrap(M())
    original = nn.Module._call_impl

    def scaled(self, *a, **k):
        out = original(self, *a, **k)
        return out * 2 if isinstance(self, nn.Linear) else out

    def run(i):
        try:
            if i in (2, 3):
                nn.Module._call_impl = scaled
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.Module._call_impl = original

    return run
