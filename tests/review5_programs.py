# ruff: noqa: B006, B019, B023, B028, E731, E741 (the programs are written as users write them)
"""Review round 5: programs aimed at this round's shortcuts (instance facts read in C, flatten_inputs' leaf path, the
left-over walk past logging.Manager, made_modules/world repair of clean objects, the last-serving entry first,
redteam5's fixes), for tests/test_review5.py. Same shape as tests/redteam3_programs.py: each `make(wrap)` builds a
fresh world and returns `run(i)`, call i with the changes a user makes between calls, returning what is compared."""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import types

import torch
from redteam_battery import grads, inp, lin, registry
from torch import nn

PROGRAMS, program = registry()


def _kind(v):
    """What a stored value is, as compared with eager: a real tensor's values, or its type's name."""
    if isinstance(v, torch.Tensor):
        return [type(v).__name__, v.detach().clone()] if type(v) in (torch.Tensor, nn.Parameter) else type(v).__name__
    return repr(v)


# ---- 1. instance facts: a class's __mro__ and a tensor's __dict__ read in C --------------------------------------


@program
def tensor_attribute_flag_flipped(wrap):
    """A held buffer carries a Python attribute (`buf.scale`) the forward branches on; the caller sets it between
    calls (setattr, __dict__ item, __dict__ replaced, deleted)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.register_buffer("buf", torch.ones(4))
            s.buf.scale = 1.0

        def forward(s, x):
            k = getattr(s.buf, "scale", 5.0)
            return s.l(x) * k + s.buf

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.buf.scale = 2.0
        if i == 5:
            m.buf.__dict__["scale"] = 3.0
        if i == 7:
            m.buf.__dict__ = {"scale": 4.0}
        if i == 9:
            del m.buf.scale
        with torch.no_grad():
            return [f(inp(i))]

    return run


class _Half(torch.Tensor):
    pass


@program
def tensor_class_swapped(wrap):
    """A held tensor's `__class__` is swapped to a subclass between calls (then back)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.w = torch.ones(4)
            s.w.tag = "a"

        def forward(s, x):
            y = s.l(x) * s.w
            return y + (1.0 if type(s.w) is torch.Tensor else 10.0)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.w.__class__ = _Half
        if i == 5:
            m.w.__class__ = torch.Tensor
        with torch.no_grad():
            out = f(inp(i))
        return [type(out).__name__, out.as_subclass(torch.Tensor)]

    return run


class _MixA:
    def gain(self):
        return 2.0


class _MixB:
    def gain(self):
        return 7.0


class _Base:
    def gain(self):
        return 1.0


@program
def class_bases_assigned(wrap):
    """A module's class inherits `gain` from a mixin; the caller reassigns a base's `__bases__` between calls."""

    class Mid(_Base):
        pass

    class M(nn.Module, Mid):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * s.gain()

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            Mid.__bases__ = (_MixA,)
        if i == 5:
            Mid.__bases__ = (_MixB,)
        if i == 7:
            Mid.__bases__ = (_Base,)
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def instance_class_swapped(wrap):
    """The module instance's `__class__` is swapped to a sibling class with another forward between calls."""

    class A(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * 2

    class B(A):
        def forward(s, x):
            return s.l(x) - 3

    m = A()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.__class__ = B
        if i == 5:
            m.__class__ = A
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def metaclass_attribute_changed(wrap):
    """A config class with a metaclass whose `__getattr__` answers missing attributes; the metaclass's answer and the
    class's own attribute change between calls."""

    class Meta(type):
        default = 2.0

        def __getattr__(cls, name):
            return Meta.default

    class Cfg(metaclass=Meta):
        eps = 0.5

    l = lin()

    def fwd(x):
        return l(x) * Cfg.scale + Cfg.eps

    f = wrap(fwd)

    def run(i):
        if i == 3:
            Meta.default = 4.0
        if i == 5:
            Cfg.eps = 1.5
        if i == 7:
            Cfg.scale = 9.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def base_class_method_patched_through_mro(wrap):
    """A method found through a plain class's MRO (two levels up) is patched on the grand-base between calls."""

    class G:
        def act(self, t):
            return t.relu()

    class P(G):
        pass

    class M(nn.Module, P):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.act(s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            G.act = lambda self, t: t.tanh()
        if i == 5:
            P.act = lambda self, t: t * 3
        if i == 7:
            del P.act
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def tensor_input_attribute(wrap):
    """An input tensor carries an attribute the forward reads; the caller passes the same tensor with the attribute
    changed, and fresh tensors with and without it."""
    l = lin()

    def fwd(x, mask):
        return l(x) * getattr(mask, "weight", 1.0) + mask

    f = wrap(fwd)
    mask = torch.ones(4)
    mask.weight = 2.0

    def run(i):
        if i == 3:
            mask.weight = 5.0
        if i == 5:
            mask.__dict__.clear()
        m = mask if i < 7 else torch.ones(4)
        if i == 8:
            m.weight = 0.5
        with torch.no_grad():
            return [f(inp(i), m)]

    return run


LONG = {"memo_settled_then_changed": 45}  # (programs run for more calls: the per-call memo settles first)


@program
def memo_settled_then_changed(wrap):
    """Twenty calls that settle the guard memo, then: a buffer's Python attribute written (setattr, `__dict__` item,
    `__dict__` replaced, deleted), a base class's `__bases__` assigned, a held tensor's `__class__` swapped and back,
    the buffer replaced."""

    class Mid(_Base):
        pass

    class M(nn.Module, Mid):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.register_buffer("buf", torch.ones(4))
            s.buf.scale = 1.0
            s.w = torch.ones(4)

        def forward(s, x):
            k = getattr(s.buf, "scale", 5.0)
            return s.l(x) * k * s.gain() + s.buf + (0.0 if type(s.w) is torch.Tensor else 10.0)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 20:
            m.buf.scale = 2.0
        if i == 23:
            m.buf.__dict__["scale"] = 3.0
        if i == 26:
            m.buf.__dict__ = {"scale": 4.0}
        if i == 29:
            del m.buf.scale
        if i == 32:
            Mid.__bases__ = (_MixA,)
        if i == 35:
            m.w.__class__ = _Half
        if i == 38:
            m.w.__class__ = torch.Tensor
        if i == 41:
            m.buf = torch.full((4,), 2.0)
        with torch.no_grad():
            return [f(inp(i % 3)).as_subclass(torch.Tensor)]

    return run


# ---- 2. flatten_inputs' leaf path ---------------------------------------------------------------------------------

_Pair = collections.namedtuple("_Pair", "a b")


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    scale: float


class _Seq:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


class _List(list):
    pass


class _Dict(dict):
    pass


@program
def inputs_of_every_container_kind(wrap):
    """Namedtuple, list/dict subclasses, a dataclass and an iterable object passed positionally and by keyword, their
    contents changed between calls."""
    l = lin()

    def fwd(p, lst, d, b, s, *, kw_pair=None, kw_list=None):
        out = l(p.a) * p.b + sum(lst) + d["k"] * b.scale + b.x + sum(s)
        if kw_pair is not None:
            out = out + kw_pair.a * kw_pair.b
        if kw_list is not None:
            out = out + len(kw_list)
        return out

    f = wrap(fwd)

    def run(i):
        p = _Pair(inp(i), 2.0 if i < 3 else 3.0)
        lst = _List([inp(i + 1)] * (1 if i < 4 else 2))
        d = _Dict(k=inp(i + 2))
        b = _Batch(inp(i + 3), 1.0 if i < 5 else 2.0)
        s = _Seq([inp(i + 4)] * (1 if i < 6 else 3))
        kw = {} if i % 2 else {"kw_pair": _Pair(inp(i), float(i % 3)), "kw_list": _List(range(i % 4))}
        with torch.no_grad():
            return [f(p, lst, d, b, s, **kw)]

    return run


@program
def leaf_only_object_arguments(wrap):
    """Only leaves (no tuple/list/dict argument): an object holding tensors passed positionally then by keyword, its
    tensor replaced and an attribute changed between calls."""
    l = lin()

    class Cache:
        def __init__(s):
            s.k = torch.zeros(4)
            s.n = 0

    def fwd(x, cache, scale=1.0):
        cache.n += 1
        out = l(x) * scale + cache.k
        cache.k = out.detach().mean(0)
        return out

    f = wrap(fwd)
    c = Cache()

    def run(i):
        with torch.no_grad():
            out = f(inp(i), c) if i % 2 else f(inp(i), cache=c, scale=2.0 if i > 4 else 1.0)
        return [out, c.k.clone(), c.n]

    return run


@program
def leaf_only_kwargs_order_and_aliasing(wrap):
    """Leaf-only calls: keyword order swapped, the same tensor passed twice (aliased, written in place through one
    name), a Parameter passed where a tensor was."""
    l = lin()

    def fwd(x, a=None, b=None):
        a.add_(1.0)
        return l(x) + a * 2 + b

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        t = torch.ones(4)
        u = torch.zeros(4)
        with torch.no_grad():
            if i % 3 == 0:
                out = f(x, a=t, b=u)
            elif i % 3 == 1:
                out = f(x, b=t, a=t)
            else:
                out = f(x, b=u, a=nn.Parameter(t, requires_grad=False))
        return [out, t, u]

    return run


# ---- 3. the left-over walk past logging.Manager ----------------------------------------------------------------------

_log = logging.getLogger("rv5.model")


@program
def traced_value_stored_on_another_logger(wrap):
    """Forward logs through its module's logger, and stashes an activation on another logger (fetched by name) and
    on a handler of it: the caller reads them after each call."""
    other = logging.getLogger("rv5.stash")
    handler = logging.NullHandler()
    other.addHandler(handler)
    l = lin()

    def fwd(x):
        h = l(x)
        _log.debug("forward")
        logging.getLogger("rv5.stash").last = h
        handler.last = h * 2
        return h + 1

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        return [out, _kind(other.last), _kind(handler.last)]

    return run


@program
def logger_attribute_read_by_name(wrap):
    """Forward reads a factor the caller keeps on a named logger (`logging.getLogger("rv5.cfg").factor`), changed
    between calls."""
    lg = logging.getLogger("rv5.cfg")
    lg.factor = 1.0
    l = lin()

    def fwd(x):
        return l(x) * logging.getLogger("rv5.cfg").factor

    f = wrap(fwd)

    def run(i):
        lg.factor = 1.0 + (i // 3)
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def thread_attribute_read(wrap):
    """Forward reads a scale the caller keeps on the current thread object, changed between calls."""
    import threading

    l = lin()

    def fwd(x):
        return l(x) * getattr(threading.current_thread(), "rv5_scale", 1.0)

    f = wrap(fwd)

    def run(i):
        threading.current_thread().rv5_scale = 2.0 + (i // 3)
        with torch.no_grad():
            out = f(inp(i))
        if i == 9:
            del threading.current_thread().rv5_scale
        return [out]

    return run


@program
def traced_value_stored_through_logger_registry(wrap):
    """Forward reads only its module's logger; it stores an activation on a logger reached through the logger's
    manager (the registry of every logger)."""
    other = logging.getLogger("rv5.reg")
    l = lin()

    def fwd(x):
        h = l(x)
        _log.manager.loggerDict["rv5.reg"].seen = h
        return h * 2

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        return [out, _kind(other.seen)]

    return run


@program
def traced_value_stored_through_sys_modules(wrap):
    """Forward stores an activation on a module object reached through `sys.modules`."""
    mod = types.ModuleType("rv5_stash_mod")
    sys.modules["rv5_stash_mod"] = mod
    l = lin()

    def fwd(x):
        h = l(x)
        sys.modules["rv5_stash_mod"].last = h
        return h - 1

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        return [out, _kind(mod.last)]

    return run


@program
def traced_value_in_logger_filter(wrap):
    """A logging filter object of the caller's, held by the module's logger, gets an activation stored on it by the
    forward through the logger's filters list."""

    class Keep(logging.Filter):
        pass

    flt = Keep()
    _log.addFilter(flt)
    l = lin()

    def fwd(x):
        h = l(x)
        _log.filters[-1].value = h
        return h * 3

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        r = [out, _kind(flt.value)]
        if i == 5:
            _log.removeFilter(flt)
        return r

    return run


# ---- 4. made_modules / world repair of objects the walk found clean ----------------------------------------------------


class _Sub(nn.Module):
    def __init__(s):
        super().__init__()
        s.l = lin(1)

    def forward(s, x):
        return s.l(x)


@program
def forward_stores_into_submodule_dict(wrap):
    """Forward stores activations into a submodule through `object.__setattr__`, `vars(m)[k]`, `__dict__[k]`, and a
    plain list attribute; the caller reads them after each call."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.sub = _Sub()
            s.hist = []

        def forward(s, x):
            h = s.sub(x)
            object.__setattr__(s.sub, "a", h)
            vars(s.sub)["b"] = h * 2
            s.sub.__dict__["c"] = h.sum()
            s.hist.append(h.mean())
            return h + 1

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        return [out, _kind(m.sub.a), _kind(m.sub.b), _kind(m.sub.c), len(m.hist), [_kind(v) for v in m.hist]]

    return run


@program
def forward_registers_buffer_and_parameter(wrap):
    """Forward registers a buffer holding an activation and (first call only) a parameter on a submodule; the caller
    reads the buffer and trains the parameter."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.sub = _Sub()

        def forward(s, x):
            h = s.sub(x)
            s.sub.register_buffer("last", h.detach().mean(0))
            if not hasattr(s.sub, "gain"):
                s.sub.register_parameter("gain", nn.Parameter(torch.ones(4)))
            return h * s.sub.gain

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad()
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), _kind(m.sub.last), sorted(k for k, _ in m.named_buffers()), grads(m)]

    return run


@program
def forward_writes_buffers_dict_directly(wrap):
    """Forward writes `_buffers` and `_parameters` of a submodule directly (no register call) and a child module made
    in forward into `_modules`."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.sub = _Sub()

        def forward(s, x):
            h = s.sub(x)
            s.sub._buffers["stat"] = h.detach().sum(0)
            if "extra" not in s._modules:
                s._modules["extra"] = lin(3)
            return s._modules["extra"](h)

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            out = f(inp(i))
        return [out, _kind(m.sub.stat), sorted(dict(m.named_modules()))]

    return run


@program
def submodule_attribute_set_by_caller_between_calls(wrap):
    """The caller stores a tensor into a submodule's __dict__ with object.__setattr__ between calls; forward reads
    it if present."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.sub = _Sub()

        def forward(s, x):
            h = s.sub(x)
            extra = s.sub.__dict__.get("bias2")
            return h if extra is None else h + extra

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            object.__setattr__(m.sub, "bias2", torch.full((4,), 5.0))
        if i == 5:
            vars(m.sub)["bias2"] = torch.full((4,), -2.0)
        if i == 7:
            del m.sub.__dict__["bias2"]
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- 5. the last-serving compiled entry first ----------------------------------------------------------------------


@program
def library_function_patched_for_the_first_calls(wrap):
    """`F.gelu` replaced by the user's function for the first calls (through nn.GELU: library code calls it), then
    put back; the last-serving entry is the patched one."""
    import torch.nn.functional as F

    m = nn.Sequential(lin(), nn.GELU())
    f = wrap(m)
    original = F.gelu
    mine = lambda t, approximate="none": t * 0.5

    def run(i):
        try:
            if i < 3 or i == 6:
                F.gelu = mine
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            F.gelu = original

    return run


@program
def alternating_shapes_dtypes_grad(wrap):
    """Calls alternate between shapes, dtypes and requires_grad (entries whose guards overlap), outputs and grads
    compared at each call."""
    l = lin()
    f = wrap(lambda x: l(x.float()).relu() * 2)

    def run(i):
        n = (2, 3, 2, 5)[i % 4]
        x = inp(i, n=n)
        if i % 3 == 1:
            x = x.double()
        if i % 2:
            x.requires_grad_(True)
        l.zero_grad()
        y = f(x)
        if y.requires_grad:
            y.sum().backward()
        return [y.detach(), grads(l), None if x.grad is None else x.grad.clone()]

    return run


@program
def alternating_flag_constant(wrap):
    """A Python flag alternates between calls; each value's entry must serve only its own calls."""
    l = lin()
    cfg = types.SimpleNamespace(mode=0)

    def fwd(x):
        h = l(x)
        return h * 2 if cfg.mode == 0 else (h - 1 if cfg.mode == 1 else h.tanh())

    f = wrap(fwd)

    def run(i):
        cfg.mode = (0, 1, 0, 2, 1, 2, 0)[i % 7]
        with torch.no_grad():
            return [f(inp(i))]

    return run


# ---- 7. variants of redteam5's fixes --------------------------------------------------------------------------------


@program
def module_class_call_patched_on_subclass(wrap):
    """The user's module class (not nn.Module) gains a `__call__` between calls, then loses it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(0)
            s.b = lin(1)

        def forward(s, x):
            return s.b(s.a(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            nn.Linear.__call__ = lambda self, x: nn.Module.__call__(self, x) * 2
        if i == 5:
            del nn.Linear.__call__
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def defaultdict_factory_changed_in_place(wrap):
    """A held defaultdict whose factory is a bound method of a config object; the config's value changes."""

    class Cfg:
        v = 1.0

        def make(self):
            return torch.full((4,), self.v)

    cfg = Cfg()
    l = lin()
    store = collections.defaultdict(cfg.make)

    def fwd(x, key):
        return l(x) + store[key]

    f = wrap(fwd)

    def run(i):
        if i == 2:
            cfg.v = 3.0
        with torch.no_grad():
            out = f(inp(i), f"k{i}")
        return [out, sorted(store), [store[k] for k in sorted(store)]]

    return run


@program
def builtin_shadowed_in_builtins_module(wrap):
    """The traced code calls `max`; the caller patches `builtins.max` itself between calls (then restores it)."""
    import builtins

    real = builtins.max
    l = lin()

    def fwd(x):
        return l(x) * max(2, 3)

    f = wrap(fwd)

    def run(i):
        if i == 3:
            builtins.max = lambda *a: 10
        if i == 4:
            builtins.max = real
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def compile_builtin_in_forward(wrap):
    """`compile()` + `types.FunctionType` of a string in forward (not eval/exec), reading a global changed between
    calls."""
    l = lin()
    g = {"SCALE": 2.0}

    def fwd(x):
        code = compile("lambda t: t * SCALE", "<rv5>", "eval")
        fn = types.FunctionType(code.co_consts[0], g) if False else eval(code, g)
        return fn(l(x))

    f = wrap(fwd)

    def run(i):
        if i == 3:
            g["SCALE"] = 5.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


RV5_SCALE = 2.0


@program
def eval_handed_to_a_c_caller(wrap):
    """`eval` called by C code the forward calls (`map(eval, exprs)`, `operator.call(eval, expr)`): the expression
    reads a module global the caller changes between calls."""
    import operator

    l = lin()

    def fwd(x):
        h = l(x)
        return h * list(map(eval, ["RV5_SCALE * 2"]))[0] + operator.call(eval, "RV5_SCALE")

    f = wrap(fwd)

    def run(i):
        globals()["RV5_SCALE"] = 2.0 + (i // 3)
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def getattr_builtin_dynamic_name(wrap):
    """`getattr(self, name)` with a name from a config the caller changes; the attribute values change too."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.alpha = 1.0
            s.beta = 2.0
            s.which = "alpha"

        def forward(s, x):
            return s.l(x) * getattr(s, s.which)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.which = "beta"
        if i == 4:
            m.beta = 7.0
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def custom_function_backward_reads_closure(wrap):
    """A custom autograd.Function defined in a closure whose backward reads a closure cell the caller changes."""
    state = {"k": 1.0}

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * state["k"]

    l = lin()
    f = wrap(lambda x: Scale.apply(l(x)).sum(-1))

    def run(i):
        if i == 3:
            state["k"] = -1.0
        l.zero_grad()
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), grads(l)]

    return run


@program
def forward_pre_hook_partial(wrap):
    """A forward pre-hook that is a functools.partial over a mutable config; the config changes between calls."""
    import functools

    cfg = {"k": 1.0}

    def hook(c, mod, args):
        c["n"] = c.get("n", 0) + 1
        return (args[0] * c["k"],)

    m = nn.Sequential(lin(0), nn.ReLU(), lin(1))
    m[2].register_forward_pre_hook(functools.partial(hook, cfg))
    f = wrap(m)

    def run(i):
        if i == 2:
            cfg["k"] = 4.0
        with torch.no_grad():
            return [f(inp(i)), cfg["n"]]

    return run


RV5_FILL = 0.0


class _Filling(dict):
    def __missing__(self, key):
        value = torch.full((4,), RV5_FILL)
        self[key] = value
        return value


class _FillingDD(collections.defaultdict):
    def __missing__(self, key):
        value = torch.full((4,), RV5_FILL + 1)
        self[key] = value
        return value


@program
def dict_subclass_missing_reads_global(wrap):
    """Input dicts whose class's `__missing__` (a dict subclass, a defaultdict subclass) reads a module global the
    caller changes; forward reads a missing key (stored, as eager stores it)."""
    l = lin()

    def fwd(x, d, dd):
        return l(x) + d["b"] + dd["c"]

    f = wrap(fwd)

    def run(i):
        globals()["RV5_FILL"] = float(i // 3)
        d, dd = _Filling(a=torch.ones(4)), _FillingDD(list)
        with torch.no_grad():
            out = f(inp(i), d, dd)
        return [out, sorted(d), d["b"], sorted(dd), dd["c"]]

    return run


@program
def hooks_of_callable_objects_with_state(wrap):
    """A forward hook that is a callable object (its `__call__` reads and counts), a with_kwargs forward pre-hook that
    is a bound method, and a forward hook on the compiled module itself; the objects' state changes between calls."""

    class Gate:
        def __init__(self):
            self.k, self.n = 1.0, 0

        def __call__(self, mod, args, out):
            self.n += 1
            return out * self.k

    class Shift:
        def __init__(self):
            self.b = 0.0

        def pre(self, mod, args, kwargs):
            return (args[0] + self.b,), kwargs

    gate, shift, top = Gate(), Shift(), Gate()
    m = nn.Sequential(lin(0), nn.Tanh(), lin(1))
    m[0].register_forward_hook(gate)
    m[2].register_forward_pre_hook(shift.pre, with_kwargs=True)
    m.register_forward_hook(top)
    f = wrap(m)

    def run(i):
        if i == 2:
            gate.k = 3.0
        if i == 4:
            shift.b = 1.5
        if i == 6:
            top.k = -1.0
        with torch.no_grad():
            return [f(inp(i)), gate.n, top.n]

    return run


@program
def library_class_methods_patched(wrap):
    """nn.Sequential.forward and nn.Linear.forward patched on the classes between calls (then put back)."""
    m = nn.Sequential(lin(0), nn.ReLU(), lin(1))
    f = wrap(m)
    seq_forward, lin_forward = nn.Sequential.forward, nn.Linear.forward

    def run(i):
        try:
            if i in (2, 3):
                nn.Sequential.forward = lambda self, x: seq_forward(self, x) * 2
            if i in (5, 6):
                nn.Linear.forward = lambda self, x: lin_forward(self, x) - 1
            with torch.no_grad():
                return [f(inp(i))]
        finally:
            nn.Sequential.forward, nn.Linear.forward = seq_forward, lin_forward

    return run


RV5_GRAD_K = 1.0


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * RV5_GRAD_K


@program
def custom_function_inside_regions(wrap):
    """A custom autograd.Function whose backward reads a module global, called inside a region layer of a stack
    (its subgraph shared by the layers); the global changes between calls."""
    import stampout

    class Layer(nn.Module):
        def __init__(s, seed):
            super().__init__()
            s.l = lin(seed)

        @stampout.region
        def forward(s, x):
            return _ScaleGrad.apply(s.l(x)).tanh()

    m = nn.Sequential(Layer(0), Layer(1), Layer(2))
    f = wrap(m)

    def run(i):
        globals()["RV5_GRAD_K"] = 1.0 if i < 2 else -2.0
        m.zero_grad()
        y = f(inp(i))
        y.sum().backward()
        return [y.detach(), grads(m)]

    return run


@program
def anomaly_mode_and_default_dtype_in_forward(wrap):
    """Forward enters torch.autograd.detect_anomaly around part of its work and reads the process-wide flag; the
    caller switches anomaly detection on for some calls; gradients, the flag after each call."""
    import warnings

    l = lin()

    def fwd(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly(check_nan=False):
                h = l(x).tanh()
        return h * (2.0 if torch.is_anomaly_enabled() else 1.0)

    f = wrap(fwd)

    def run(i):
        torch.autograd.set_detect_anomaly(i in (2, 3))
        try:
            l.zero_grad()
            y = f(inp(i))
            y.sum().backward()
            return [y.detach(), grads(l), torch.is_anomaly_enabled()]
        finally:
            torch.autograd.set_detect_anomaly(False)

    return run

