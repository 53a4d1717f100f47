# ruff: noqa: B006, B019, B023, B028, E731, E741 (the programs are written as users write them)
"""Red-team round 4: more ordinary programs that touch the world from traced code (closure cells rebound from
outside, metaclasses, data descriptors, module `__getattr__`, generators driven with `send`, weak-value caches,
thread-locals and contextvars written, RNG reseeded or its state read, the environment written, exceptions used for
control flow, in-place updates of input views, tensor attributes, hooks added and removed between calls, parameters
reassigned, `requires_grad` flips, dtype changes, train/eval flips, recursion, shared submodules, `*args`/`**kwargs`,
NamedTuple and dataclass inputs, containers returned that alias state, whole training steps with an optimizer, user
torch-function modes around the call), for tests/test_redteam4.py. Same shape as tests/redteam3_programs.py: each
`make(wrap)` builds a fresh world (`wrap` is the identity for eager, or compiles) and returns `run(i)`: call i, with
the changes a user makes between calls, returning what is compared with eager."""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import itertools
import os
import random
import threading
import types
import typing
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from redteam_battery import grads, inp, lin, registry
from torch import nn

import stampout

PROGRAMS, program = registry()


# ---- closures -------------------------------------------------------------------------------------------------------


@program
def closure_cell_set_outside(wrap):
    """A scale kept in a closure cell, changed by a setter the caller calls between calls."""
    l = lin()

    def make():
        scale = 1.0

        def set_scale(v):
            nonlocal scale
            scale = v

        def fwd(x):
            return l(x) * scale

        return fwd, set_scale

    fwd, set_scale = make()
    f = wrap(fwd)

    def run(i):
        if i in (2, 4):
            set_scale(float(i))
        return [f(inp(i))]

    return run


@program
def closure_list_appended(wrap):
    """A closure appends the mean of each call to a list the caller reads."""
    l = lin()
    seen = []

    def fwd(x):
        y = l(x)
        seen.append(y.detach().mean())
        return y

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), list(seen)]

    return run


@program
def closure_tensor_rebound(wrap):
    """A closure over a tensor cell the caller rebinds (a new bias) and updates in place."""
    l = lin()

    def make():
        bias = torch.zeros(4)

        def fwd(x):
            return l(x) + bias

        def set_bias(b):
            nonlocal bias
            bias = b

        return fwd, set_bias, lambda: bias

    fwd, set_bias, get = make()
    f = wrap(fwd)

    def run(i):
        if i == 2:
            set_bias(torch.ones(4))
        if i == 3:
            get().add_(5)
        return [f(inp(i))]

    return run


@program
def closure_counter_in_cell_dict(wrap):
    """A closure keeps a dict of call counts by batch size, used in the computation."""
    l = lin()

    def make():
        counts = {}

        def fwd(x):
            n = x.shape[0]
            counts[n] = counts.get(n, 0) + 1
            return l(x) * counts[n]

        return fwd, counts

    fwd, counts = make()
    f = wrap(fwd)

    def run(i):
        return [f(inp(i, n=[2, 3, 2, 2, 3][i])), dict(counts)]

    return run


# ---- classes: class attributes, metaclasses, descriptors, properties, __getattr__ -------------------------------------


@program
def metaclass_instance_count(wrap):
    """A metaclass counts instances; forward makes a small helper object each call and scales by the count."""

    class Counting(type):
        made = 0

        def __call__(cls, *a, **k):
            Counting.made += 1
            return super().__call__(*a, **k)

    class Scale(metaclass=Counting):
        def __init__(self, v):
            self.v = v

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            sc = Scale(2.0)
            return s.l(x) * sc.v + Counting.made

    f = wrap(M())

    def run(i):
        return [f(inp(i)), Counting.made]

    return run


@program
def metaclass_property_config(wrap):
    """A config class whose metaclass property reads a class-level dict; the dict changes between calls."""

    class Meta(type):
        @property
        def scale(cls):
            return cls._table["scale"]

    class Cfg(metaclass=Meta):
        _table = {"scale": 1.0}

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * Cfg.scale

    f = wrap(M())

    def run(i):
        if i == 2:
            Cfg._table["scale"] = 3.0
        if i == 4:
            Cfg._table = {"scale": -1.0}
        return [f(inp(i))]

    return run


@program
def classmethod_step_counter(wrap):
    """A classmethod increments a class-level step used in the computation."""

    class M(nn.Module):
        step = 0

        @classmethod
        def tick(cls):
            cls.step += 1
            return cls.step

        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) / s.tick()

    f = wrap(M())

    def run(i):
        return [f(inp(i)), M.step]

    return run


class _PerInstance:
    """A data descriptor storing per-instance values in a WeakKeyDictionary (not in the instance's __dict__)."""

    def __init__(self, default):
        self.default = default
        self.values = weakref.WeakKeyDictionary()

    def __get__(self, obj, owner):
        return self if obj is None else self.values.get(obj, self.default)

    def __set__(self, obj, value):
        self.values[obj] = value


@program
def descriptor_weak_storage(wrap):
    """A data descriptor keeps the value outside the instance: set between calls."""

    class M(nn.Module):
        gain = _PerInstance(1.0)

        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * s.gain

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.gain = 4.0
        if i == 3:
            M.gain.values[m] = -2.0
        return [f(inp(i))]

    return run


@program
def property_setter_in_forward(wrap):
    """A temperature property with a setter, annealed in forward."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s._t = 1.0

        @property
        def temperature(s):
            return s._t

        @temperature.setter
        def temperature(s, v):
            s._t = max(v, 0.1)

        def forward(s, x):
            y = s.l(x) / s.temperature
            s.temperature = s.temperature * 0.5
            return y

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m._t]

    return run


@program
def module_getattr_defaults(wrap):
    """A module with __getattr__ falling back to a defaults dict; the dict and the instance change between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.defaults = {"alpha": 0.5}

        def __getattr__(s, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                d = s.__dict__.get("defaults", {})
                if name in d:
                    return d[name]
                raise

        def forward(s, x):
            return s.l(x) * s.alpha

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.defaults["alpha"] = 2.0
        if i == 3:
            m.alpha = 7.0
        if i == 4:
            del m.alpha
        return [f(inp(i))]

    return run


@program
def class_swapped_between_calls(wrap):
    """obj.__class__ reassigned between calls (a config switching behaviour)."""

    class A:
        def act(self, t):
            return t.relu()

    class B:
        def act(self, t):
            return t.tanh()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.policy = A()

        def forward(s, x):
            return s.policy.act(s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.policy.__class__ = B
        if i == 4:
            m.policy.__class__ = A
        return [f(inp(i))]

    return run


@program
def class_method_monkeypatched(wrap):
    """A method of a helper class replaced on the class between calls."""

    class Act:
        def __call__(self, t):
            return t * 2

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.act = Act()

        def forward(s, x):
            return s.act(s.l(x))

    f = wrap(M())

    def run(i):
        if i == 2:
            Act.__call__ = lambda self, t: t * 3
        return [f(inp(i))]

    return run


@program
def slots_config(wrap):
    """A __slots__ config object changed between calls."""

    class Cfg:
        __slots__ = ("scale", "shift")

        def __init__(self):
            self.scale, self.shift = 1.0, 0.0

    class M(nn.Module):
        def __init__(s, cfg):
            super().__init__()
            s.l = lin()
            s.cfg = cfg

        def forward(s, x):
            return s.l(x) * s.cfg.scale + s.cfg.shift

    cfg = Cfg()
    f = wrap(M(cfg))

    def run(i):
        if i == 2:
            cfg.shift = 1.5
        if i == 3:
            cfg.scale = -1.0
        return [f(inp(i))]

    return run


# ---- generators, iterators, weakrefs, contextvars, thread-locals ------------------------------------------------------


@program
def generator_send(wrap):
    """A coroutine-style generator held on the module, driven with send() per call (a running average)."""

    def averager():
        total, n, avg = 0.0, 0, None
        while True:
            v = yield avg
            total += v
            n += 1
            avg = total / n

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.avg = averager()
            next(s.avg)

        def forward(s, x):
            a = s.avg.send(float(x.shape[0]))
            return s.l(x) * a

    f = wrap(M())

    def run(i):
        return [f(inp(i, n=[2, 3, 4, 2, 3][i]))]

    return run


@program
def itertools_cycle_held(wrap):
    """itertools.cycle of scales held on the module."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scales = itertools.cycle([1.0, 2.0, 3.0])

        def forward(s, x):
            return s.l(x) * next(s.scales)

    f = wrap(M())

    def run(i):
        return [f(inp(1))]

    return run


@program
def weak_value_cache(wrap):
    """A WeakValueDictionary cache of position tensors keyed by length, held by the caller too."""
    keep = []

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cache = weakref.WeakValueDictionary()

        def forward(s, x):
            n = x.shape[0]
            pos = s.cache.get(n)
            if pos is None:
                pos = torch.arange(n, dtype=torch.float32)[:, None]
                s.cache[n] = pos
                keep.append(pos)
            return s.l(x) + pos

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            keep.clear()
        return [f(inp(i, n=[2, 3, 2, 3, 2][i])), sorted(m.cache.keys())]

    return run


@program
def weakref_finalize_count(wrap):
    """weakref to the input tensor; the caller checks whether forward kept it alive."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.last = None

        def forward(s, x):
            s.last = weakref.ref(x)
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        x = inp(i)
        out = f(x)
        return [out, m.last is not None and m.last() is x]

    return run


_MODE = contextvars.ContextVar("mode", default="train")


@program
def contextvar_set_in_forward(wrap):
    """forward sets a contextvar for its children and resets it with the token; a child reads it."""

    class Child(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * (2.0 if _MODE.get() == "inner" else 1.0)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.c = Child()

        def forward(s, x):
            tok = _MODE.set("inner")
            try:
                y = s.c(x)
            finally:
                _MODE.reset(tok)
            return y + s.c(x)

    f = wrap(M())

    def run(i):
        return [f(inp(i)), _MODE.get()]

    return run


@program
def contextvar_left_set(wrap):
    """forward records the last batch size in a contextvar (never reset); the caller reads it."""
    var = contextvars.ContextVar("last_n", default=-1)
    l = lin()

    def fwd(x):
        var.set(x.shape[0])
        return l(x)

    f = wrap(fwd)

    def run(i):
        if i == 3:
            var.set(-5)
        return [f(inp(i, n=[2, 3, 2, 3, 2][i])), var.get()]

    return run


_TLS = threading.local()


@program
def thread_local_written(wrap):
    """forward counts calls in a thread-local; the count scales the output."""
    _TLS.calls = 0
    l = lin()

    def fwd(x):
        _TLS.calls += 1
        return l(x) * _TLS.calls

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), _TLS.calls]

    return run


# ---- RNG, time, environment, global dicts ----------------------------------------------------------------------------


@program
def manual_seed_in_forward(wrap):
    """forward reseeds torch with a per-call seed and draws noise."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.seed = 0

        def forward(s, x):
            torch.manual_seed(s.seed)
            s.seed += 1
            return s.l(x) + torch.randn_like(x)

    f = wrap(M())

    def run(i):
        return [f(inp(i)), torch.rand(2)]

    return run


@program
def rand_then_caller_draws(wrap):
    """forward draws noise; the caller draws after each call too (the generator must advance as in eager)."""
    l = lin()

    def fwd(x):
        return l(x) + 0.1 * torch.rand(x.shape)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), torch.rand(3)]

    return run


@program
def bernoulli_mask_aot(wrap):
    """A bernoulli mask of given probabilities, gradients through the masked product."""
    l = lin()

    def fwd(x, p):
        return (l(x) * torch.bernoulli(p)).sum()

    f = wrap(fwd)

    def run(i):
        l.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        out = f(inp(i), torch.full((2, 4), 0.5))
        out.backward()
        return [out, grads(l)]

    return run


@program
def python_random_seeded_in_forward(wrap):
    """random.seed in forward with the batch size, then random.random."""
    l = lin()

    def fwd(x):
        random.seed(x.shape[0])
        return l(x) * random.random()

    f = wrap(fwd)

    def run(i):
        return [f(inp(i, n=[2, 3, 2, 3, 2][i])), random.random()]

    return run


@program
def numpy_generator_on_module(wrap):
    """A numpy Generator held on the module draws a scale per call."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.rng = np.random.default_rng(0)

        def forward(s, x):
            return s.l(x) * float(s.rng.uniform())

    f = wrap(M())

    def run(i):
        return [f(inp(i))]

    return run


@program
def torch_rng_state_restored(wrap):
    """forward saves torch's RNG state, draws, restores (reproducible noise each call)."""
    l = lin()

    def fwd(x):
        st = torch.get_rng_state()
        n = torch.randn(x.shape)
        torch.set_rng_state(st)
        return l(x) + n

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), torch.rand(2)]

    return run


@program
def environ_written(wrap):
    """forward writes os.environ (a flag for later code) and reads another variable."""
    os.environ.pop("RT4_LAST_N", None)
    os.environ["RT4_SCALE"] = "1"
    l = lin()

    def fwd(x):
        os.environ["RT4_LAST_N"] = str(x.shape[0])
        return l(x) * float(os.environ["RT4_SCALE"])

    f = wrap(fwd)

    def run(i):
        if i == 2:
            os.environ["RT4_SCALE"] = "3"
        return [f(inp(i, n=[2, 3, 2, 3, 2][i])), os.environ.get("RT4_LAST_N")]

    return run


_REGISTRY = {}


@program
def global_dict_shapes(wrap):
    """forward records each input's shape in a global dict, keyed by name."""
    _REGISTRY.clear()
    l = lin()

    def fwd(x, name):
        _REGISTRY[name] = tuple(x.shape)
        return l(x)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i, n=[2, 3, 2, 3, 2][i]), ["a", "b", "a", "c", "a"][i]), dict(_REGISTRY)]

    return run


_SEEN_TOTAL = {"n": 0, "sum": None}


@program
def global_dict_tensor_accumulator(wrap):
    """A global dict accumulates a detached running sum tensor."""
    _SEEN_TOTAL.update(n=0, sum=None)
    l = lin()

    def fwd(x):
        y = l(x)
        s = y.detach().sum(0)
        _SEEN_TOTAL["sum"] = s if _SEEN_TOTAL["sum"] is None else _SEEN_TOTAL["sum"] + s
        _SEEN_TOTAL["n"] += 1
        return y

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), _SEEN_TOTAL["n"], _SEEN_TOTAL["sum"].clone()]

    return run


# ---- exceptions ----------------------------------------------------------------------------------------------------


@program
def getattr_fallback_exception(wrap):
    """try: self.extra_bias except AttributeError: zero; the attribute appears, changes, and goes."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            try:
                b = s.extra
            except AttributeError:
                b = 0.0
            return s.l(x) + b

    m = M()
    f = wrap(m)

    def run(i):
        if i == 1:
            m.extra = 2.0
        if i == 2:
            m.extra = torch.ones(4)
        if i == 3:
            del m.extra
        return [f(inp(i))]

    return run


@program
def keyerror_fallback(wrap):
    """A dict lookup whose KeyError picks a default; the dict gains the key between calls."""
    table = {}
    l = lin()

    def fwd(x, key):
        try:
            s = table[key]
        except KeyError:
            s = 1.0
        return l(x) * s

    f = wrap(fwd)

    def run(i):
        if i == 2:
            table["a"] = 5.0
        return [f(inp(i), "a")]

    return run


@program
def stopiteration_exhausted(wrap):
    """next(it, default) on an iterator held by the module, exhausted after two calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.warm = iter([0.1, 0.5])

        def forward(s, x):
            return s.l(x) * next(s.warm, 1.0)

    f = wrap(M())

    def run(i):
        return [f(inp(i))]

    return run


# ---- in-place ops on inputs and views, tensor attributes -----------------------------------------------------------


@program
def inplace_input_view(wrap):
    """forward scales the first column of its input in place through a view."""
    l = lin()

    def fwd(x):
        x[:, 0].mul_(2)
        return l(x)

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        out = f(x)
        return [out, x]

    return run


@program
def inplace_on_view_of_input_passed(wrap):
    """The caller passes a view (a transpose) of a bigger tensor; forward writes it in place."""
    l = lin()

    def fwd(x):
        x.add_(1)
        return l(x)

    f = wrap(fwd)
    base = torch.zeros(4, 6)

    def run(i):
        v = base[:, i:i + 2].t()
        out = f(v)
        return [out, base.clone()]

    return run


@program
def inplace_input_aliases_param(wrap):
    """The caller passes a slice of the model's own weight as input (no_grad); forward writes it in place."""
    l = lin()

    def fwd(x):
        y = l(x)
        x.mul_(0.5)
        return y

    f = wrap(fwd)

    def run(i):
        with torch.no_grad():
            out = f(l.weight[:2])
        return [out, l.weight.detach().clone()]

    return run


@program
def tensor_attr_written_on_input(wrap):
    """forward tags its input tensor with an attribute; the caller reads it."""
    l = lin()

    def fwd(x):
        x.seen = getattr(x, "seen", 0) + 1
        return l(x)

    f = wrap(fwd)
    x0 = inp(0)

    def run(i):
        x = x0 if i % 2 == 0 else inp(i)
        out = f(x)
        return [out, x.seen]

    return run


@program
def tensor_attr_read_on_input(wrap):
    """The input tensor carries a `scale` attribute the forward reads; it changes between calls."""
    l = lin()

    def fwd(x):
        return l(x) * getattr(x, "scale", 1.0)

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        if i >= 2:
            x.scale = float(i)
        return [f(x)]

    return run


@program
def tensor_attr_on_output(wrap):
    """forward tags its output tensor with metadata (a Python attribute)."""
    l = lin()

    def fwd(x):
        y = l(x)
        y.meta = {"n": x.shape[0]}
        return y

    f = wrap(fwd)

    def run(i):
        y = f(inp(i, n=[2, 3, 2, 3, 2][i]))
        return [y, getattr(y, "meta", None)]

    return run


@program
def param_attr_tag_read(wrap):
    """A parameter carries a Python attribute (`p.lr_scale`) read in forward; changed between calls."""
    l = lin()
    l.weight.lr_scale = 1.0

    def fwd(x):
        return l(x) * l.weight.lr_scale

    f = wrap(fwd)

    def run(i):
        if i == 2:
            l.weight.lr_scale = 0.5
        return [f(inp(i))]

    return run


# ---- grad modes, autocast, hooks, parameters, requires_grad, dtype, train/eval --------------------------------------


@program
def no_grad_branch_in_region(wrap):
    """A region computes a detached statistic under no_grad and a trainable path; grads compared."""

    class Block(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        @stampout.region
        def forward(s, x):
            with torch.no_grad():
                m = s.l(x).mean()
            return s.l(x) - m

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = Block(), Block()

        def forward(s, x):
            return s.b(s.a(x))

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


@program
def caller_no_grad_toggle(wrap):
    """The caller calls under no_grad, then with grad, then inference_mode."""
    l = lin()

    def fwd(x):
        return l(x).relu()

    f = wrap(fwd)

    def run(i):
        l.zero_grad(set_to_none=True)
        if i in (0, 3):
            with torch.no_grad():
                out = f(inp(i))
            return [out, out.requires_grad]
        if i == 4:
            with torch.inference_mode():
                out = f(inp(i))
            return [out.clone(), out.requires_grad]
        out = f(inp(i))
        out.sum().backward()
        return [out, out.requires_grad, grads(l)]

    return run


@program
def caller_autocast_toggle(wrap):
    """The caller wraps some calls in CPU autocast (bfloat16)."""
    l = lin()

    def fwd(x):
        return l(x) * 2

    f = wrap(fwd)

    def run(i):
        if i % 2:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = f(inp(i))
        else:
            out = f(inp(i))
        return [out.float(), str(out.dtype)]

    return run


@program
def forward_pre_hook_added_removed(wrap):
    """A forward pre hook that rescales the input, added before call 1 and removed before call 3."""
    l = lin()
    m = nn.Sequential(l, nn.ReLU())
    f = wrap(m)
    handle = []
    calls = []

    def pre(mod, args):
        calls.append(1)
        return (args[0] * 3,)

    def run(i):
        if i == 1:
            handle.append(l.register_forward_pre_hook(pre))
        if i == 3:
            handle.pop().remove()
        return [f(inp(i)), len(calls)]

    return run


@program
def forward_hook_counts_calls(wrap):
    """A forward hook counting calls and storing the output norm, kept across calls."""
    m = nn.Sequential(lin(), nn.Tanh(), lin(1))
    log = []

    def hook(mod, args, out):
        log.append(float(out.detach().norm()))

    m[0].register_forward_hook(hook)
    f = wrap(m)

    def run(i):
        return [f(inp(i)), len(log)]

    return run


@program
def parameter_reassigned(wrap):
    """The caller replaces a parameter with a new nn.Parameter between calls."""
    l = lin()
    f = wrap(l)

    def run(i):
        if i == 2:
            l.weight = nn.Parameter(torch.eye(4))
        if i == 3:
            l.bias = None
        l.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(l)]

    return run


@program
def requires_grad_flip(wrap):
    """The caller freezes the weight before call 2 and unfreezes it before call 4."""
    l = lin()
    m = nn.Sequential(l, nn.Tanh())
    f = wrap(m)

    def run(i):
        if i == 2:
            l.weight.requires_grad_(False)
        if i == 4:
            l.weight.requires_grad_(True)
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


@program
def dtype_switch(wrap):
    """The model is converted to double between calls (inputs follow)."""
    m = nn.Sequential(lin(), nn.GELU())
    f = wrap(m)

    def run(i):
        if i == 2:
            m.double()
        if i == 4:
            m.float()
        dt = torch.float64 if i in (2, 3) else torch.float32
        out = f(inp(i).to(dt))
        return [out.float(), str(out.dtype)]

    return run


@program
def train_eval_flip_dropout_bn(wrap):
    """BatchNorm and dropout; train/eval flipped between calls; running stats compared."""
    m = nn.Sequential(lin(), nn.BatchNorm1d(4), nn.Dropout(0.0))
    f = wrap(m)

    def run(i):
        if i == 2:
            m.eval()
        if i == 3:
            m.train()
        if i == 4:
            m[1].eval()
        out = f(inp(i, n=3))
        return [out, m[1].running_mean.clone(), int(m[1].num_batches_tracked)]

    return run


@program
def train_flag_read_in_forward(wrap):
    """forward scales by a factor chosen on self.training; the caller flips only the child."""

    class C(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * (0.5 if s.training else 1.0)

    m = nn.Sequential(C(), C())
    f = wrap(m)

    def run(i):
        if i == 1:
            m[1].eval()
        if i == 3:
            m.train()
        return [f(inp(i))]

    return run


@program
def eval_in_forward(wrap):
    """forward switches a child to eval after the first call (a warm-up)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.bn = nn.BatchNorm1d(4)
            s.calls = 0

        def forward(s, x):
            y = s.bn(s.l(x))
            s.calls += 1
            if s.calls == 2:
                s.bn.eval()
            return y

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i, n=3)), m.bn.training, m.bn.running_mean.clone()]

    return run


# ---- structure: nested regions, recursion, shared submodules, args/kwargs, NamedTuple/dataclass inputs ----------------


@program
def recursive_tree(wrap):
    """A recursive module applying a shared child to a depth that is an argument."""

    class Node(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x, depth):
            if depth == 0:
                return x
            return s.forward(torch.tanh(s.l(x)), depth - 1) + x

    f = wrap(Node())

    def run(i):
        return [f(inp(i), [1, 2, 2, 3, 1][i])]

    return run


@program
def shared_submodule_two_paths(wrap):
    """One Linear registered under two names, called through both; a hook on it counts."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            shared = lin()
            s.enc, s.dec = shared, shared
            s.mid = lin(1)

        def forward(s, x):
            return s.dec(s.mid(s.enc(x)))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.dec = lin(3)
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


@program
def nested_region_counter(wrap):
    """Nested regions: the outer counts its calls on the module and the inner reads the count."""

    class Inner(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        @stampout.region
        def forward(s, x, k):
            return s.l(x) * k

    class Outer(nn.Module):
        def __init__(s):
            super().__init__()
            s.inner = Inner()
            s.k = 1

        @stampout.region
        def forward(s, x):
            s.k += 1
            return s.inner(x, s.k) + s.inner(x, 1)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = Outer(), Outer()

        def forward(s, x):
            return s.b(s.a(x))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.a.k, m.b.k]

    return run


@program
def kwonly_and_varargs(wrap):
    """forward(*xs, scale, **opts): the number of tensors, the keyword and the options change."""
    l = lin()

    def fwd(*xs, scale=1.0, **opts):
        y = sum(l(x) for x in xs) * scale
        if opts.get("relu"):
            y = y.relu()
        return y

    f = wrap(fwd)

    def run(i):
        xs = [inp(i + k) for k in range([1, 2, 2, 3, 1][i])]
        kw = [{}, {"relu": True}, {"relu": False}, {"scale": 2.0}, {"scale": 2, "relu": 1}][i]
        return [f(*xs, **kw)]

    return run


@program
def kwargs_dict_mutated(wrap):
    """forward pops an option out of the dict the caller passed with ** (eager pops from a copy)."""
    l = lin()
    opts = {"scale": 2.0}

    def fwd(x, **kw):
        s = kw.pop("scale", 1.0)
        return l(x) * s

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), **opts), dict(opts)]

    return run


class Batch(typing.NamedTuple):
    x: torch.Tensor
    mask: torch.Tensor
    temperature: float


@program
def namedtuple_input(wrap):
    """A NamedTuple batch with a float temperature that changes."""
    l = lin()

    def fwd(b):
        return (l(b.x) / b.temperature).masked_fill(b.mask, 0.0)

    f = wrap(fwd)

    def run(i):
        b = Batch(inp(i), inp(i + 7) > 0, [1.0, 1.0, 2.0, 0.5, 2.0][i])
        return [f(b)]

    return run


@dataclasses.dataclass
class Req:
    x: torch.Tensor
    ids: list
    scale: float = 1.0
    out: torch.Tensor | None = None


@program
def dataclass_input_written(wrap):
    """A dataclass request: forward reads a list field and a float and writes its output onto the request."""
    l = lin()

    def fwd(r):
        y = l(r.x)[r.ids] * r.scale
        r.out = y
        r.ids.append(len(r.ids))
        return y.sum()

    f = wrap(fwd)

    def run(i):
        r = Req(inp(i, n=4), [0, 1] if i < 3 else [1, 2], [1.0, 2.0, 2.0, 1.0, 1.0][i])
        s = f(r)
        return [s, r.out, list(r.ids)]

    return run


@program
def returns_state_list(wrap):
    """forward appends to a history list it returns (the caller gets the module's own list)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.history = []

        def forward(s, x):
            y = s.l(x)
            s.history.append(y.detach())
            return y, s.history

    m = M()
    f = wrap(m)

    def run(i):
        y, hist = f(inp(i))
        same = hist is m.history
        seen = [t.clone() for t in hist]
        if i == 2:
            hist.clear()
        if i == 3:
            m.history = [torch.zeros(2, 4)]
        return [y, same, len(m.history), seen]

    return run


@program
def returns_state_dict(wrap):
    """forward returns the module's stats dict after updating it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.stats = {"calls": 0}

        def forward(s, x):
            s.stats["calls"] += 1
            return s.l(x), s.stats

    m = M()
    f = wrap(m)

    def run(i):
        y, st = f(inp(i))
        st["seen"] = i
        if i == 2:
            m.stats = {"calls": 10}
        return [y, st is m.stats, dict(m.stats)]

    return run


@program
def returns_input_list(wrap):
    """forward appends its result to the list it was given and returns that list."""
    l = lin()

    def fwd(xs):
        xs.append(l(xs[-1]))
        return xs

    f = wrap(fwd)

    def run(i):
        xs = [inp(i)]
        out = f(xs)
        return [out is xs, len(xs), xs[-1]]

    return run


@program
def returns_same_tensor_twice(wrap):
    """forward returns one tensor in two places of a dict and a tuple."""
    l = lin()

    def fwd(x):
        y = l(x)
        return {"a": y, "b": y}, (y, x)

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        d, t = f(x)
        return [d["a"] is d["b"], t[0] is d["a"], t[1] is x, d["a"]]

    return run


# ---- whole training steps, optimizers, user modes ---------------------------------------------------------------------


@program
def train_step_sgd_momentum(wrap):
    """A compiled training step: forward, backward, clip, optimizer step, zero_grad."""
    m = nn.Sequential(lin(), nn.Tanh(), lin(1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        loss = m(x).pow(2).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    f = wrap(step)

    def run(i):
        loss = f(inp(i))
        return [loss, {k: v.detach().clone() for k, v in m.state_dict().items()}]

    return run


@program
def train_step_with_scheduler(wrap):
    """A compiled step that also steps an LR scheduler (Python state on the optimizer's param groups)."""
    m = lin()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def step(x):
        loss = m(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss.detach()

    f = wrap(step)

    def run(i):
        loss = f(inp(i))
        return [loss, opt.param_groups[0]["lr"], m.weight.detach().clone()]

    return run


class _CountingMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@program
def user_torch_function_mode(wrap):
    """The caller runs the model under its own TorchFunctionMode (counting calls; later, changing results)."""
    l = lin()

    def fwd(x):
        return torch.tanh(l(x))

    f = wrap(fwd)

    def run(i):
        if i in (1, 3):
            mode = _CountingMode()
            with mode:
                out = f(inp(i))
            return [out, mode.n > 0]
        return [f(inp(i))]

    return run


class _Doubling(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.tanh else out


@program
def user_mode_changes_results(wrap):
    """A TorchFunctionMode of the caller's that changes tanh's result, active on some calls."""
    l = lin()

    def fwd(x):
        return torch.tanh(l(x))

    f = wrap(fwd)

    def run(i):
        if i in (1, 2):
            with _Doubling():
                return [f(inp(i))]
        return [f(inp(i))]

    return run


@program
def saved_tensors_hooks_caller(wrap):
    """The caller wraps the call in saved_tensors_hooks that count packs and unpacks."""
    l = lin()
    counts = {"pack": 0, "unpack": 0}

    def pack(t):
        counts["pack"] += 1
        return t

    def unpack(t):
        counts["unpack"] += 1
        return t

    def fwd(x):
        return torch.tanh(l(x)) * x

    f = wrap(fwd)

    def run(i):
        l.zero_grad(set_to_none=True)
        if i in (1, 3):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = f(inp(i, grad=True))
        else:
            out = f(inp(i, grad=True))
        out.sum().backward()
        return [out, grads(l), counts["pack"] > 0, counts["unpack"] > 0]

    return run


@program
def caller_tensor_hook_on_input(wrap):
    """The caller registers a hook on its input (and retains grad) before the call."""
    l = lin()
    seen = []

    def fwd(x):
        return l(x).tanh()

    f = wrap(fwd)

    def run(i):
        x = inp(i, grad=True)
        h = x * 1.0
        h.register_hook(lambda g: seen.append(g.clone()) or g * 2)
        h.retain_grad()
        out = f(h)
        out.sum().backward()
        return [out, x.grad, h.grad, len(seen)]

    return run


@program
def functional_call_params(wrap):
    """torch.func.functional_call with a dict of parameters passed in (a meta-learning inner step)."""
    m = lin()

    def fwd(params, x):
        return torch.func.functional_call(m, params, (x,)).sum()

    f = wrap(fwd)

    def run(i):
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        if i == 3:
            params["weight"] = params["weight"] * 0 + 1
        out = f(params, inp(i))
        return [out, m.weight.detach().clone()]

    return run


@program
def global_function_swapped(wrap):
    """A module-level activation chosen by name in a global dict, swapped between calls."""
    acts = {"act": F.relu}
    l = lin()

    def fwd(x):
        return acts["act"](l(x))

    f = wrap(fwd)

    def run(i):
        if i == 2:
            acts["act"] = torch.sigmoid
        if i == 3:
            acts["act"] = functools.partial(F.leaky_relu, negative_slope=0.3)
        return [f(inp(i))]

    return run


@program
def instance_forward_replaced(wrap):
    """The caller replaces a child's forward with a bound method of another function between calls."""

    class C(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x)

    def doubled(s, x):
        return s.l(x) * 2

    m = nn.Sequential(C(), C())
    f = wrap(m)

    def run(i):
        if i == 2:
            m[1].forward = types.MethodType(doubled, m[1])
        if i == 4:
            del m[1].forward
        return [f(inp(i))]

    return run


@program
def deque_window_stack(wrap):
    """A deque(maxlen=3) of detached outputs held on the module, stacked into the output."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.win = collections.deque(maxlen=3)

        def forward(s, x):
            y = s.l(x)
            s.win.append(y.detach())
            return y + torch.stack(list(s.win)).mean(0)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), len(m.win)]

    return run


@program
def counter_update(wrap):
    """A collections.Counter of batch sizes held on the module, its most common size used."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.sizes = collections.Counter()

        def forward(s, x):
            s.sizes[x.shape[0]] += 1
            return s.l(x) * s.sizes.most_common(1)[0][0]

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i, n=[2, 3, 3, 2, 2][i])), dict(m.sizes)]

    return run


@program
def string_log_attr(wrap):
    """forward appends to a string attribute (a trace log)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.log = ""

        def forward(s, x):
            s.log += f"{x.shape[0]};"
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i, n=[2, 3, 3, 2, 2][i])), m.log]

    return run


@program
def default_dtype_changed(wrap):
    """forward makes a tensor with the default dtype; the caller changes it between calls."""
    l = lin()

    def fwd(x):
        return l(x) + torch.ones(4).to(x.dtype) * torch.tensor(0.5).element_size()

    f = wrap(fwd)

    def run(i):
        try:
            if i == 2:
                torch.set_default_dtype(torch.float64)
            return [f(inp(i))]
        finally:
            torch.set_default_dtype(torch.float32)

    return run


@program
def num_threads_branch(wrap):
    """forward branches on torch.get_num_threads(); the caller changes it."""
    l = lin()
    before = torch.get_num_threads()

    def fwd(x):
        return l(x) * (1.0 if torch.get_num_threads() > 1 else 3.0)

    f = wrap(fwd)

    def run(i):
        try:
            torch.set_num_threads(1 if i in (2, 3) else 2)
            return [f(inp(i))]
        finally:
            torch.set_num_threads(before)

    return run


@program
def module_attr_deleted_in_forward(wrap):
    """forward consumes a one-shot attribute (`del self.pending`)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            if hasattr(s, "pending"):
                y = y + s.pending
                del s.pending
            return y

    m = M()
    f = wrap(m)

    def run(i):
        if i in (1, 3):
            m.pending = float(i)
        return [f(inp(i)), hasattr(m, "pending")]

    return run


@program
def setattr_dynamic_name(wrap):
    """forward stores the output under a name made from a counter (`setattr(self, f"out{k}", ...)`)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.k = 0

        def forward(s, x):
            y = s.l(x)
            setattr(s, f"out{s.k % 2}", y.detach())
            s.k += 1
            return y

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), getattr(m, "out0", None), getattr(m, "out1", None)]

    return run


@program
def spectral_norm_training(wrap):
    """nn.utils.spectral_norm (its pre-hook runs power iteration, updating buffers in place)."""
    m = nn.utils.spectral_norm(lin())
    f = wrap(m)

    def run(i):
        if i == 3:
            m.eval()
        out = f(inp(i))
        return [out, m.weight_u.clone()]

    return run


@program
def parametrize_weight(wrap):
    """torch.nn.utils.parametrize: an orthogonal-ish parametrization; the original changes between calls."""

    class Sym(nn.Module):
        def forward(s, w):
            return (w + w.T) / 2

    l = lin()
    torch.nn.utils.parametrize.register_parametrization(l, "weight", Sym())
    f = wrap(l)

    def run(i):
        if i == 2:
            with torch.no_grad():
                l.parametrizations.weight.original.mul_(2)
        l.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(l)]

    return run


@program
def vmap_in_forward(wrap):
    """torch.func.vmap over a per-example function inside forward."""
    l = lin()

    def per(x):
        return l(x).norm()

    def fwd(xs):
        return torch.func.vmap(per)(xs)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i, n=3))]

    return run


@program
def global_tensor_rebound(wrap):
    """A module-level tensor (a global) rebound and updated in place by the caller."""
    global _GLOBAL_BIAS
    _GLOBAL_BIAS = torch.zeros(4)
    l = lin()

    def fwd(x):
        return l(x) + _GLOBAL_BIAS

    f = wrap(fwd)

    def run(i):
        global _GLOBAL_BIAS
        if i == 2:
            _GLOBAL_BIAS = torch.ones(4)
        if i == 3:
            _GLOBAL_BIAS.add_(1)
        return [f(inp(i))]

    return run


_GLOBAL_BIAS = torch.zeros(4)


@program
def optimizer_step_compiled(wrap):
    """Backward outside, the optimizer step (Adam) compiled on its own (`compiled_step = compile(step)`)."""
    m = nn.Sequential(lin(), nn.Tanh(), lin(1))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)

    def step():
        opt.step()
        opt.zero_grad()

    f = wrap(step)

    def run(i):
        m(inp(i)).pow(2).mean().backward()
        f()
        return [{k: v.detach().clone() for k, v in m.state_dict().items()}, grads(m)]

    return run


@program
def grad_clip_compiled(wrap):
    """Backward outside; gradient clipping and a manual SGD update compiled (reads p.grad in library code)."""
    m = lin()

    def step():
        nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
                p.grad = None

    f = wrap(step)

    def run(i):
        m(inp(i)).pow(2).mean().backward()
        f()
        return [m.weight.detach().clone(), grads(m)]

    return run


# ---- round 4, second batch -----------------------------------------------------------------------------------------


@program
def partial_keywords_mutated(wrap):
    """An activation kept as a functools.partial; the caller changes its keywords dict in place."""
    m = nn.Sequential(lin())
    act = functools.partial(F.leaky_relu, negative_slope=0.1)
    l = m[0]

    def fwd(x):
        return act(l(x))

    f = wrap(fwd)

    def run(i):
        if i == 2:
            act.keywords["negative_slope"] = 0.5
        return [f(inp(i))]

    return run


@program
def float_list_item_changed(wrap):
    """A list of per-layer scales held by the module, one item changed in place by the caller."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList([lin(0), lin(1)])
            s.scales = [1.0, 1.0]

        def forward(s, x):
            for l, sc in zip(s.ls, s.scales):
                x = l(x) * sc
            return x

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.scales[1] = 0.25
        if i == 3:
            m.scales.append(9.0)
        return [f(inp(i))]

    return run


@program
def module_dict_key_added(wrap):
    """A ModuleDict iterated in forward; the caller adds a head between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.heads = nn.ModuleDict({"a": lin(0)})

        def forward(s, x):
            return {k: h(x) for k, h in s.heads.items()}

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.heads["b"] = lin(1)
        if i == 3:
            del m.heads["a"]
        return [f(inp(i))]

    return run


@program
def callback_argument_per_call(wrap):
    """A callback passed per call: a new lambda each call closing over a changing value, and a counter."""
    l = lin()
    calls = []

    def fwd(x, post):
        return post(l(x))

    f = wrap(fwd)

    def run(i):
        k = [1.0, 2.0, 2.0, 3.0, 1.0][i]

        def post(t):
            calls.append(k)
            return t * k

        return [f(inp(i), post), list(calls)]

    return run


@program
def function_defaults_changed(wrap):
    """The compiled function's default argument changed through __defaults__ / __kwdefaults__."""
    l = lin()

    def fwd(x, scale=1.0, *, shift=0.0):
        return l(x) * scale + shift

    f = wrap(fwd)

    def run(i):
        if i == 2:
            fwd.__defaults__ = (3.0,)
        if i == 3:
            fwd.__kwdefaults__ = {"shift": 1.0}
        return [f(inp(i))]

    return run


@program
def class_forward_replaced(wrap):
    """The class's forward replaced between calls (a patch applied to every instance)."""

    class C(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x)

    m = nn.Sequential(C(), nn.ReLU())
    f = wrap(m)

    def run(i):
        if i == 2:
            C.forward = lambda s, x: s.l(x) * -1
        return [f(inp(i))]

    return run


@program
def base_class_attr_changed(wrap):
    """A default on a base class changed between calls (the subclass does not override it)."""

    class Base(nn.Module):
        gain = 1.0

    class C(Base):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * s.gain

    f = wrap(C())

    def run(i):
        if i == 2:
            Base.gain = 5.0
        if i == 3:
            C.gain = -1.0
        return [f(inp(i))]

    return run


@program
def getattr_functional_by_name(wrap):
    """getattr(F, self.act) with the name changed between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.act = "relu"

        def forward(s, x):
            return getattr(F, s.act)(s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.act = "silu"
        return [f(inp(i))]

    return run


@program
def dict_update_self_in_forward(wrap):
    """forward applies an override dict onto itself (`self.__dict__.update(overrides)`) given per call."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scale = 1.0

        def forward(s, x, overrides):
            s.__dict__.update(overrides)
            return s.l(x) * s.scale

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i), [{}, {"scale": 2.0}, {}, {"scale": 0.5}, {}][i]), m.scale]

    return run


@program
def generator_argument(wrap):
    """A torch.Generator passed per call (seeded by the caller) draws the noise."""
    l = lin()

    def fwd(x, g):
        return l(x) + torch.randn(x.shape, generator=g)

    f = wrap(fwd)

    def run(i):
        g = torch.Generator().manual_seed([1, 2, 1, 3, 3][i])
        out = f(inp(i), g)
        return [out, torch.randn(2, generator=g)]

    return run


@program
def channels_last_switch(wrap):
    """A conv model switched to channels_last between calls (weights' strides change)."""
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    f = wrap(m)

    def run(i):
        if i == 2:
            m.to(memory_format=torch.channels_last)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, 3, 6, 6, generator=g)
        if i >= 2:
            x = x.to(memory_format=torch.channels_last)
        out = f(x)
        return [out, out.is_contiguous(memory_format=torch.channels_last)]

    return run


@program
def weight_data_swapped(wrap):
    """The caller swaps a weight's .data for a new tensor (same shape) and, later, another shape."""
    l = lin()
    f = wrap(l)

    def run(i):
        if i == 2:
            l.weight.data = torch.eye(4)
        if i == 3:
            l.weight.data = torch.ones(4, 4) * 0.5
        return [f(inp(i))]

    return run


@program
def unregistered_module_in_list(wrap):
    """A module held in a plain list (not registered); the caller replaces it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.extra = [lin(1)]

        def forward(s, x):
            return s.extra[0](s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.extra[0] = lin(2)
        if i == 3:
            with torch.no_grad():
                m.extra[0].bias.add_(1)
        return [f(inp(i))]

    return run


@program
def lazy_heads_in_forward(wrap):
    """forward creates a head for a new size lazily (a module made during the call, stored in a ModuleDict)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.heads = nn.ModuleDict()

        def forward(s, x):
            key = str(x.shape[0])
            if key not in s.heads:
                s.heads[key] = lin(x.shape[0])
            return s.heads[key](x)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i, n=[2, 3, 2, 3, 4][i])), sorted(m.heads.keys())]

    return run


@program
def input_requires_grad_branch(wrap):
    """forward branches on x.requires_grad (an input that sometimes requires grad)."""
    l = lin()

    def fwd(x):
        return l(x) * (2.0 if x.requires_grad else 1.0)

    f = wrap(fwd)

    def run(i):
        x = inp(i, grad=i in (1, 3))
        out = f(x)
        if x.requires_grad:
            out.sum().backward()
            return [out, x.grad]
        return [out]

    return run


@program
def enum_mode_config(wrap):
    """An Enum member on the module picks the pooling; changed between calls."""
    import enum

    class Pool(enum.Enum):
        MEAN = "mean"
        MAX = "max"

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.pool = Pool.MEAN

        def forward(s, x):
            y = s.l(x)
            return y.mean(0) if s.pool is Pool.MEAN else y.amax(0)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.pool = Pool.MAX
        return [f(inp(i))]

    return run


@program
def sys_module_flag(wrap):
    """forward reads a flag from a module object found in sys.modules (a plugin registry)."""
    import sys

    mod = types.ModuleType("rt4_plugin")
    mod.ENABLED = False
    sys.modules["rt4_plugin"] = mod
    l = lin()

    def fwd(x):
        plugin = sys.modules.get("rt4_plugin")
        y = l(x)
        return y * 2 if plugin is not None and plugin.ENABLED else y

    f = wrap(fwd)

    def run(i):
        if i == 2:
            mod.ENABLED = True
        if i == 3:
            del sys.modules["rt4_plugin"]
        return [f(inp(i))]

    return run


@program
def nonlocal_closure_made_in_forward(wrap):
    """forward defines a nested function that closes over and updates a local (pure per call)."""
    l = lin()

    def fwd(x):
        total = 0

        def add(t):
            nonlocal total
            total += 1
            return t + total

        return add(add(l(x)))

    f = wrap(fwd)

    def run(i):
        return [f(inp(i))]

    return run


@program
def same_input_twice_then_distinct(wrap):
    """f(x, x) then f(x, y): forward writes its second argument in place."""
    l = lin()

    def fwd(a, b):
        b.mul_(2)
        return l(a) + b

    f = wrap(fwd)

    def run(i):
        x = inp(i)
        y = x if i % 2 == 0 else inp(i + 10)
        out = f(x, y)
        return [out, x, y]

    return run


@program
def kwarg_order_swapped(wrap):
    """Keyword arguments passed in a different order between calls."""
    l = lin()

    def fwd(*, a, b):
        return l(a) - b

    f = wrap(fwd)

    def run(i):
        a, b = inp(i), inp(i + 5)
        return [f(a=a, b=b) if i % 2 == 0 else f(b=b, a=a)]

    return run


# ---- round 4, third batch: modules reached as values, imports in forward, more state --------------------------------


_FLAGS_MOD = types.ModuleType("rt4_flags")
_FLAGS_MOD.FAST = False


@program
def import_inside_forward(wrap):
    """forward imports a module and reads a flag off it (`import rt4_flags2 as flags` inside the function)."""
    import sys

    mod = types.ModuleType("rt4_flags2")
    mod.SCALE = 1.0
    sys.modules["rt4_flags2"] = mod
    l = lin()

    def fwd(x):
        import rt4_flags2

        return l(x) * rt4_flags2.SCALE

    f = wrap(fwd)

    def run(i):
        if i == 2:
            mod.SCALE = 4.0
        if i == 3:
            sys.modules["rt4_flags2"] = types.ModuleType("rt4_flags2")
            sys.modules["rt4_flags2"].SCALE = -1.0
        return [f(inp(i))]

    return run


@program
def library_module_on_attribute(wrap):
    """A module object kept as an attribute (`self.flags = flags_module`), a flag read off it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.flags = _FLAGS_MOD

        def forward(s, x):
            y = s.l(x)
            return y.relu() if s.flags.FAST else y.tanh()

    _FLAGS_MOD.FAST = False
    f = wrap(M())

    def run(i):
        if i == 2:
            _FLAGS_MOD.FAST = True
        return [f(inp(i))]

    return run


@program
def torch_backend_flag_on_attribute(wrap):
    """torch.backends.mkldnn kept on the module; forward branches on its `enabled` flag (a torch setting)."""
    import torch.backends.mkldnn as mkl

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.backend = mkl

        def forward(s, x):
            return s.l(x) * (2.0 if s.backend.is_available() and torch._C._get_mkldnn_enabled() else 1.0)

    f = wrap(M())

    def run(i):
        before = torch._C._get_mkldnn_enabled()
        try:
            if i == 2:
                torch._C._set_mkldnn_enabled(not before)
            return [f(inp(i))]
        finally:
            torch._C._set_mkldnn_enabled(before)

    return run


@program
def closure_module_flag(wrap):
    """A factory closes over a flags module it was given; a flag changes between calls."""
    l = lin()

    def make(flags):
        def fwd(x):
            return l(x) * (3.0 if flags.FAST else 1.0)

        return fwd

    _FLAGS_MOD.FAST = False
    f = wrap(make(_FLAGS_MOD))

    def run(i):
        if i == 2:
            _FLAGS_MOD.FAST = True
        return [f(inp(i))]

    return run


@program
def functools_reduce_layers(wrap):
    """functools.reduce over the layers with a lambda reading a per-model gain."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList([lin(0), lin(1), lin(2)])
            s.gain = 1.0

        def forward(s, x):
            return functools.reduce(lambda h, l: l(h) * s.gain, s.ls, x)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.gain = 0.5
        return [f(inp(i))]

    return run


@program
def map_filter_over_modules(wrap):
    """map/filter over submodules chosen by an attribute flag on each child."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList([lin(0), lin(1), lin(2)])
            for k, l in enumerate(s.ls):
                l.active = k != 1

        def forward(s, x):
            return sum(map(lambda l: l(x), filter(lambda l: l.active, s.ls)))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.ls[1].active = True
        if i == 3:
            m.ls[0].active = False
        return [f(inp(i))]

    return run


@program
def sorted_by_key_attr(wrap):
    """Children applied in the order of a priority attribute (sorted with a key)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList([lin(0), lin(1)])
            s.ls[0].prio, s.ls[1].prio = 0, 1

        def forward(s, x):
            for l in sorted(s.ls, key=lambda l: l.prio):
                x = l(x).tanh()
            return x

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.ls[0].prio = 5
        return [f(inp(i))]

    return run


@program
def cached_property_on_module(wrap):
    """functools.cached_property computing a mask from a size attribute; the caller invalidates it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.n = 4

        @functools.cached_property
        def mask(s):
            return torch.tril(torch.ones(s.n, s.n))

        def forward(s, x):
            return s.l(x) @ s.mask

    m = M()
    f = wrap(m)

    def run(i):
        if i == 3:
            del m.__dict__["mask"]
        return [f(inp(i)), "mask" in m.__dict__]

    return run


@program
def object_setattr_bypass_caller(wrap):
    """The caller changes a scale with object.__setattr__ (bypassing Module.__setattr__) between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scale = 1.0

        def forward(s, x):
            return s.l(x) * s.scale

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            object.__setattr__(m, "scale", 3.0)
        if i == 3:
            m.__dict__["scale"] = -2.0
        return [f(inp(i))]

    return run


@program
def param_in_place_between_calls(wrap):
    """The caller updates a parameter in place under no_grad between calls (a manual optimizer)."""
    l = lin()
    f = wrap(l)

    def run(i):
        l.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        with torch.no_grad():
            for p in l.parameters():
                p -= 0.1 * p.grad
        return [out, l.weight.detach().clone()]

    return run


@program
def buffer_replaced_other_shape(wrap):
    """A buffer reassigned with another shape between calls (broadcasting still works)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.register_buffer("bias2", torch.zeros(4))

        def forward(s, x):
            return s.l(x) + s.bias2

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.bias2 = torch.ones(2, 4)
        if i == 3:
            m.bias2 = torch.ones(1, 4) * 3
        return [f(inp(i))]

    return run


@program
def exception_from_helper_caught(wrap):
    """A helper raises a ValueError on a Python condition; forward catches it and falls back."""
    l = lin()

    class Cfg:
        mode = "a"

    def pick(mode):
        if mode not in ("a", "b"):
            raise ValueError(mode)
        return 1.0 if mode == "a" else 2.0

    def fwd(x):
        try:
            s = pick(Cfg.mode)
        except ValueError:
            s = -1.0
        return l(x) * s

    f = wrap(fwd)

    def run(i):
        Cfg.mode = ["a", "b", "zzz", "a", "zzz"][i]
        return [f(inp(i))]

    return run


@program
def finally_counter(wrap):
    """A try/finally in forward that counts calls in the finally block."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.done = 0

        def forward(s, x):
            try:
                return s.l(x) * (s.done + 1)
            finally:
                s.done += 1

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.done]

    return run


@program
def with_statement_user_cm(wrap):
    """A user context manager in forward that toggles an attribute on enter/exit and counts entries."""

    class Toggle:
        def __init__(self, mod):
            self.mod = mod

        def __enter__(self):
            self.mod.inside = True
            self.mod.entries += 1

        def __exit__(self, *a):
            self.mod.inside = False

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.inside = False
            s.entries = 0

        def forward(s, x):
            with Toggle(s):
                y = s.l(x) * (2.0 if s.inside else 1.0)
            return y * (1.0 if s.inside else 3.0)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.entries, m.inside]

    return run


# ---- round 4, fourth batch: outputs that alias state or each other ---------------------------------------------------


@program
def returns_held_opts_caller_edits(wrap):
    """forward reads and returns its options dict; the caller edits the returned dict (the module's own)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.opts = {"scale": 1.0}

        def forward(s, x):
            return s.l(x) * s.opts["scale"], s.opts

    m = M()
    f = wrap(m)

    def run(i):
        y, opts = f(inp(i))
        if i == 1:
            opts["scale"] = 5.0
        return [y, dict(m.opts)]

    return run


@program
def returns_held_list_twice_in_dict(wrap):
    """forward returns a per-call dict holding the module's history list twice and a fresh list."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.history = []

        def forward(s, x):
            y = s.l(x)
            s.history.append(float(x.shape[0]))
            fresh = [y]
            return {"a": s.history, "b": s.history, "y": fresh, "y2": fresh}

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i, n=[2, 3, 2, 2, 3][i]))
        return [out["a"] is m.history, out["a"] is out["b"], out["y"] is out["y2"], out["y"][0], list(m.history)]

    return run


@program
def region_returns_held_list(wrap):
    """A region returning its output and the module's log list; two layers."""

    class L(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.log = []

        @stampout.region
        def forward(s, x):
            y = s.l(x).tanh()
            s.log.append(1)
            return y, s.log

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = L(0), L(1)

        def forward(s, x):
            y, la = s.a(x)
            y, lb = s.b(y)
            return y, la is s.a.log, lb is s.b.log, len(la), len(lb)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i))]

    return run


@program
def defaultdict_output(wrap):
    """forward groups outputs in a defaultdict(list) made per call; the caller appends to it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            out = collections.defaultdict(list)
            out["h"].append(s.l(x))
            out["h"].append(s.l(x) * 2)
            return out

    f = wrap(M())

    def run(i):
        out = f(inp(i))
        out["new"].append(i)
        return [type(out).__name__, out["h"], sorted(out)]

    return run


@program
def output_set_of_shapes(wrap):
    """forward returns a set of the sizes it saw (made per call)."""
    l = lin()

    def fwd(x):
        y = l(x)
        return y, {tuple(x.shape), tuple(y.shape), "done"}

    f = wrap(fwd)

    def run(i):
        y, seen = f(inp(i, n=[2, 3, 2, 3, 2][i]))
        keep = sorted(map(str, seen))
        seen.add("mine")
        return [y, keep]

    return run


@program
def nested_list_shared_inner(wrap):
    """forward returns [[y], inner, inner] where inner is one list; the caller changes it."""
    l = lin()

    def fwd(x):
        y = l(x)
        inner = [y * 2]
        return [[y], inner, inner]

    f = wrap(fwd)

    def run(i):
        out = f(inp(i))
        same = out[1] is out[2]
        out[1].append(0)
        return [same, len(out[2]), out[0][0]]

    return run


@dataclasses.dataclass
class _Cache:
    keys: list = dataclasses.field(default_factory=list)

    def add(self, t):
        self.keys.append(t)
        return self


@program
def dataclass_cache_returned(wrap):
    """A dataclass cache passed in, filled and returned (the caller's own object)."""
    l = lin()

    def fwd(x, cache):
        y = l(x)
        cache.add(y.detach())
        return y, cache

    f = wrap(fwd)

    def run(i):
        c = _Cache()
        y, back = f(inp(i), c)
        return [y, back is c, len(c.keys), c.keys[0]]

    return run


@program
def rg_per_layer_log(wrap):
    """Auto regions: each layer appends its index to a shared log list and scales by a per-layer attribute."""
    log = []

    class Layer(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.k = k
            s.scale = 1.0

        def forward(s, x):
            log.append(s.k)
            return s.l(x).tanh() * s.scale

    class Stack(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(Layer(k) for k in range(3))

        def forward(s, x):
            for layer in s.layers:
                x = layer(x)
            return x

    m = Stack()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.layers[1].scale = 0.5
        return [f(inp(i)), list(log)]

    return run


# ---- round 4, fifth batch: counts of calls into the user's dunder methods -------------------------------------------


class _CountingKey:
    """A dict key counting its __hash__ and __eq__ calls."""

    hashes = 0
    eqs = 0

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        type(self).hashes += 1
        return hash(self.name)

    def __eq__(self, other):
        type(self).eqs += 1
        return isinstance(other, _CountingKey) and other.name == self.name


@program
def dunder_hash_counts(wrap):
    """forward looks a scale up in a dict keyed by user objects whose __hash__/__eq__ count calls."""
    _CountingKey.hashes = _CountingKey.eqs = 0
    k = _CountingKey("a")
    table = {k: 2.0}
    l = lin()

    def fwd(x, key):
        return l(x) * table.get(key, 1.0)

    f = wrap(fwd)

    def run(i):
        key = k if i % 2 == 0 else _CountingKey("a")
        return [f(inp(i), key), _CountingKey.hashes]

    return run


class _CountingList:
    """A sequence whose __len__ and __iter__ count calls (a user dataset-like container)."""

    def __init__(self, items):
        self.items = items
        self.lens = 0
        self.iters = 0

    def __len__(self):
        self.lens += 1
        return len(self.items)

    def __iter__(self):
        self.iters += 1
        return iter(self.items)


@program
def dunder_len_iter_counts(wrap):
    """forward iterates a user container of scales held by the module; its __len__/__iter__ count calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scales = _CountingList([1.0, 2.0])

        def forward(s, x):
            y = s.l(x)
            for sc in s.scales:
                y = y * sc
            return y / len(s.scales)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.scales.items.append(3.0)
        return [f(inp(i)), m.scales.lens, m.scales.iters]

    return run


@program
def property_counting_reads(wrap):
    """A config object passed per call whose property counts its reads."""

    class Cfg:
        def __init__(self, s):
            self._s = s
            self.reads = 0

        @property
        def scale(self):
            self.reads += 1
            return self._s

    l = lin()

    def fwd(x, cfg):
        return l(x) * cfg.scale + cfg.scale

    f = wrap(fwd)
    shared = Cfg(2.0)

    def run(i):
        cfg = shared if i != 3 else Cfg(3.0)
        return [f(inp(i), cfg), cfg.reads]

    return run


@program
def dunder_bool_counts(wrap):
    """A flag object with a counting __bool__ decides a branch."""

    class Flag:
        def __init__(self):
            self.on = False
            self.asked = 0

        def __bool__(self):
            self.asked += 1
            return self.on

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.flag = Flag()

        def forward(s, x):
            return s.l(x).relu() if s.flag else s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.flag.on = True
        return [f(inp(i)), m.flag.asked]

    return run


@program
def dunder_call_counts(wrap):
    """A callable object with a call counter used as the activation."""

    class Act:
        def __init__(self):
            self.calls = 0

        def __call__(self, t):
            self.calls += 1
            return t.tanh()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.act = Act()

        def forward(s, x):
            return s.act(s.act(s.l(x)))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.act.calls]

    return run


@program
def getattr_counting_module(wrap):
    """A module whose __getattr__ counts fallbacks (a lookup of an alias name)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.misses = 0

        def __getattr__(s, name):
            if name == "proj":
                s.__dict__["misses"] = s.__dict__.get("misses", 0) + 1
                return super().__getattr__("l")
            return super().__getattr__(name)

        def forward(s, x):
            return s.proj(x)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.misses]

    return run


# ---- round 4, sixth batch: parameters and registries changed around the call ------------------------------------------


@program
def post_accumulate_grad_hook(wrap):
    """The caller registers post-accumulate-grad hooks on the parameters (an optimizer in backward) after call 1."""
    l = lin()
    seen = []
    f = wrap(l)

    def run(i):
        if i == 1:
            for p in l.parameters():
                p.register_post_accumulate_grad_hook(lambda p: seen.append(tuple(p.grad.shape)))
        l.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(l), len(seen)]

    return run


@program
def weights_tied_after_call(wrap):
    """An output projection tied to the input projection's weight after the first call."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.inp, s.out = lin(0), lin(1)

        def forward(s, x):
            return s.out(s.inp(x).tanh())

    m = M()
    f = wrap(m)

    def run(i):
        if i == 1:
            m.out.weight = m.inp.weight
        m.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(m)]

    return run


@program
def parameters_dict_edited(wrap):
    """The caller edits `_parameters` directly and registers the bias as None."""
    l = lin()
    f = wrap(l)

    def run(i):
        if i == 2:
            l._parameters["weight"] = nn.Parameter(torch.eye(4) * 2)
        if i == 3:
            del l.bias
            l.register_parameter("bias", None)
        return [f(inp(i))]

    return run


@program
def apply_flag_in_forward(wrap):
    """forward sets a flag on every child with Module.apply (a debug switch driven by the call count)."""

    class C(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.debug = False

        def forward(s, x):
            return s.l(x) * (0.0 if s.debug else 1.0) + x

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = C(0), C(1)
            s.calls = 0

        def forward(s, x):
            s.calls += 1
            flag = s.calls % 2 == 0

            def set_flag(m):
                if isinstance(m, C):
                    m.debug = flag

            s.apply(set_flag)
            return s.b(s.a(x))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.a.debug]

    return run


@program
def requires_grad_flip_in_forward(wrap):
    """forward freezes a child after two calls (`self.a.requires_grad_(False)`)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a, s.b = lin(0), lin(1)
            s.calls = 0

        def forward(s, x):
            s.calls += 1
            if s.calls == 3:
                s.a.requires_grad_(False)
            return s.b(s.a(x).tanh())

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(m)]

    return run


@program
def no_grad_decorated_forward(wrap):
    """A helper decorated with @torch.no_grad() computes a statistic used in a trainable output."""
    l = lin()

    @torch.no_grad()
    def stat(t):
        return t.abs().mean()

    def fwd(x):
        y = l(x)
        return y / (stat(y) + 1)

    f = wrap(fwd)

    def run(i):
        l.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(l)]

    return run


@program
def load_state_dict_assign(wrap):
    """load_state_dict(assign=True) swaps in new parameter objects between calls."""
    l = lin()
    f = wrap(l)

    def run(i):
        if i == 2:
            l.load_state_dict({"weight": torch.ones(4, 4), "bias": torch.zeros(4)}, assign=True)
        l.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(l)]

    return run


@program
def prune_then_remove(wrap):
    """torch.nn.utils.prune: a mask applied after call 1 (a pre-hook recomputes weight), removed after call 3."""
    import torch.nn.utils.prune as prune

    l = lin()
    f = wrap(l)

    def run(i):
        if i == 1:
            prune.l1_unstructured(l, "weight", amount=0.5)
        if i == 3:
            prune.remove(l, "weight")
        l.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(l)]

    return run


@program
def weight_norm_parametrized(wrap):
    """torch.nn.utils.parametrizations.weight_norm; the magnitude changed in place between calls."""
    l = torch.nn.utils.parametrizations.weight_norm(lin())
    f = wrap(l)

    def run(i):
        if i == 2:
            with torch.no_grad():
                l.parametrizations.weight.original0.mul_(3)
        l.zero_grad(set_to_none=True)
        y = f(inp(i))
        y.sum().backward()
        return [y, grads(l)]

    return run


@program
def helper_generator_consumed(wrap):
    """forward consumes a generator helper that yields scaled copies, counting in a module attribute."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.made = 0

        def pieces(s, y):
            for k in range(3):
                s.made += 1
                yield y * k

        def forward(s, x):
            return sum(s.pieces(s.l(x)))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), m.made]

    return run


# ---- round 4, seventh batch: Python scalars at the edges of equality ------------------------------------------------


@program
def signed_zero_argument(wrap):
    """A float argument 0.0 then -0.0 (equal, but copysign tells them apart)."""
    import math

    l = lin()

    def fwd(x, s):
        return l(x) * math.copysign(1.0, s)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [0.0, -0.0, 0.0, -0.0, -0.0][i])]

    return run


@program
def signed_zero_attribute(wrap):
    """A module attribute flipped from 0.0 to -0.0 (1/x gives inf of the other sign: clamped)."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.offset = 0.0

        def forward(s, x):
            return s.l(x) * (1.0 if str(s.offset).startswith("-") else 2.0)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.offset = -0.0
        return [f(inp(i))]

    return run


@program
def nan_flag_argument(wrap):
    """A float argument that is NaN on some calls (a 'not set' marker)."""
    import math

    l = lin()

    def fwd(x, s):
        return l(x) * (1.0 if math.isnan(s) else s)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [float("nan"), float("nan"), 2.0, float("nan"), 2.0][i])]

    return run


@program
def numpy_scalar_argument(wrap):
    """A numpy float64 scale then a Python float (equal values, other types; str shows the type)."""
    l = lin()

    def fwd(x, s):
        return l(x) * s, type(s).__name__

    f = wrap(fwd)

    def run(i):
        s = [np.float64(2.0), 2.0, np.float32(2.0), 2.0, np.float64(2.0)][i]
        y, name = f(inp(i), s)
        return [y, name]

    return run


@program
def bool_vs_int_argument(wrap):
    """True then 1 as a flag argument (the program formats it)."""
    l = lin()

    def fwd(x, flag):
        return l(x) * (2.0 if repr(flag) == "True" else 3.0)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [True, 1, True, 1, 1][i])]

    return run


@program
def tuple_vs_list_argument(wrap):
    """Dims as a tuple then an equal list (the program checks the type)."""
    l = lin()

    def fwd(x, dims):
        return l(x).sum(dim=dims[0]) * (1.0 if isinstance(dims, tuple) else 2.0)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [(0,), [0], (0,), [0], [0]][i])]

    return run


@program
def int_subclass_enum_argument(wrap):
    """An IntEnum member then the equal int (the program uses its name)."""
    import enum

    class Mode(enum.IntEnum):
        A = 1

    l = lin()

    def fwd(x, mode):
        return l(x) * (5.0 if getattr(mode, "name", None) == "A" else 1.0)

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [Mode.A, 1, Mode.A, 1, Mode.A][i])]

    return run


# ---- round 4, eighth batch: automatic regions with per-layer indices and state ---------------------------------------

_GAINS = [1.0, 1.0, 1.0]


class _IdxLayer(nn.Module):
    def __init__(s, k):
        super().__init__()
        s.l = lin(k)
        s.idx = k

    def forward(s, x):
        return s.l(x).tanh() * _GAINS[s.idx]


def _idx_stack():
    class Stack(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(_IdxLayer(k) for k in range(3))

        def forward(s, x):
            for layer in s.layers:
                x = layer(x)
            return x

    return Stack()


@program
def rg_global_gain_by_index(wrap):
    """Auto regions: each layer scales by a global list item at its index; the caller changes one item."""
    _GAINS[:] = [1.0, 1.0, 1.0]
    m = _idx_stack()
    f = wrap(m)

    def run(i):
        if i == 2:
            _GAINS[1] = 3.0
        if i == 3:
            _GAINS[2] = -1.0
        return [f(inp(i))]

    return run


@program
def rg_layers_reordered(wrap):
    """Auto regions: the caller swaps two layers of the ModuleList (their indices travel with them)."""
    _GAINS[:] = [1.0, 2.0, 3.0]
    m = _idx_stack()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.layers[0], m.layers[1] = m.layers[1], m.layers[0]
        if i == 3:
            m.layers[2].idx = 0
        return [f(inp(i))]

    return run


@program
def rg_kv_list_by_index(wrap):
    """Auto regions: a per-call list of past states indexed by layer index, written by each layer (a cache)."""

    class L(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.idx = k

        def forward(s, x, past):
            y = s.l(x).tanh()
            if past[s.idx] is not None:
                y = y + past[s.idx]
            past[s.idx] = y.detach()
            return y

    class Stack(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(L(k) for k in range(3))

        def forward(s, x, past):
            for layer in s.layers:
                x = layer(x, past)
            return x

    m = Stack()
    f = wrap(m)
    past = [None, None, None]

    def run(i):
        out = f(inp(i), past)
        return [out, [p.clone() for p in past]]

    return run


@program
def rg_layer_counter_and_shared_buffer(wrap):
    """Auto regions: each layer counts its calls and adds a buffer the caller updates in place."""

    class L(nn.Module):
        def __init__(s, k, shared):
            super().__init__()
            s.l = lin(k)
            s.calls = 0
            s.shared = shared

        def forward(s, x):
            s.calls += 1
            return s.l(x) + s.shared

    shared = torch.zeros(4)

    class Stack(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(L(k, shared) for k in range(3))

        def forward(s, x):
            for layer in s.layers:
                x = layer(x)
            return x

    m = Stack()
    f = wrap(m)

    def run(i):
        if i == 2:
            shared.add_(1)
        return [f(inp(i)), [layer.calls for layer in m.layers]]

    return run


# ---- round 4, ninth batch: arguments of many kinds ----------------------------------------------------------------


@program
def dict_input_key_order(wrap):
    """A dict of tensors whose key order changes between calls; forward concatenates its values in order."""
    l = lin()

    def fwd(d):
        return l(torch.cat(list(d.values())))

    f = wrap(fwd)

    def run(i):
        a, b = inp(i), inp(i + 9, n=1)
        d = {"a": a, "b": b} if i % 2 == 0 else {"b": b, "a": a}
        return [f(d)]

    return run


@program
def int_keyed_dict_input(wrap):
    """A dict keyed by ints (layer -> tensor) with keys changing between calls."""
    l = lin()

    def fwd(d):
        return sum(l(v) * k for k, v in sorted(d.items()))

    f = wrap(fwd)

    def run(i):
        keys = [(0, 1), (0, 1), (1, 2), (0, 2), (1, 2)][i]
        return [f({k: inp(i + k) for k in keys})]

    return run


@program
def range_and_slice_arguments(wrap):
    """A range of layer indices and a slice of rows change between calls."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList(lin(k) for k in range(4))

        def forward(s, x, which, rows):
            for k in which:
                x = s.ls[k](x).tanh()
            return x[rows]

    f = wrap(M())

    def run(i):
        which = [range(2), range(3), range(1, 3), range(2), range(0, 4, 2)][i]
        rows = [slice(0, 2), slice(0, 1), slice(1, 3), slice(None), slice(0, 2)][i]
        return [f(inp(i, n=3), which, rows)]

    return run


@program
def dtype_device_arguments(wrap):
    """A dtype argument (the output's) changes between calls."""
    l = lin()

    def fwd(x, dtype):
        return l(x).to(dtype) * 3

    f = wrap(fwd)

    def run(i):
        dt = [torch.float64, torch.float32, torch.float64, torch.bfloat16, torch.float32][i]
        y = f(inp(i), dt)
        return [y.float(), str(y.dtype)]

    return run


@program
def class_argument(wrap):
    """An activation class passed as an argument and instantiated in forward."""
    l = lin()

    def fwd(x, act_cls):
        return act_cls()(l(x))

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [nn.ReLU, nn.Tanh, nn.ReLU, nn.GELU, nn.Tanh][i])]

    return run


@program
def module_argument(wrap):
    """A head module passed as an argument: two heads of one class with other weights, alternating."""
    body = lin()
    heads = [lin(1), lin(2)]

    def fwd(x, head):
        return head(body(x).tanh())

    f = wrap(fwd)

    def run(i):
        body.zero_grad(set_to_none=True)
        y = f(inp(i), heads[[0, 1, 0, 1, 1][i]])
        y.sum().backward()
        return [y, grads(body)]

    return run


@program
def bound_method_argument(wrap):
    """A bound method of another module passed as the post-processing callable."""

    class Post(nn.Module):
        def __init__(s, scale):
            super().__init__()
            s.scale = scale

        def apply_scale(s, t):
            return t * s.scale

    l = lin()
    posts = [Post(1.0), Post(4.0)]

    def fwd(x, post):
        return post(l(x))

    f = wrap(fwd)

    def run(i):
        if i == 3:
            posts[0].scale = -1.0
        return [f(inp(i), posts[[0, 1, 0, 0, 1][i]].apply_scale)]

    return run


@program
def lambda_default_argument(wrap):
    """A lambda made per call with a default capturing the call's scale."""
    l = lin()

    def fwd(x, post):
        return post(l(x))

    f = wrap(fwd)

    def run(i):
        k = [1.0, 2.0, 2.0, 5.0, 1.0][i]
        return [f(inp(i), lambda t, k=k: t * k)]

    return run


@program
def frozenset_argument(wrap):
    """A frozenset of enabled features, changing between calls."""
    l = lin()

    def fwd(x, feats):
        y = l(x)
        if "relu" in feats:
            y = y.relu()
        if "double" in feats:
            y = y * 2
        return y

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), [frozenset(), frozenset({"relu"}), frozenset({"relu", "double"}),
                           frozenset({"double"}), frozenset({"relu"})][i])]

    return run


@program
def returns_held_cache_dict_with_tensor(wrap):
    """forward stores its output in the module's cache dict and returns that dict."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cache = {}

        def forward(s, x):
            y = s.l(x)
            s.cache["y"] = y
            s.cache["n"] = s.cache.get("n", 0) + 1
            return s.cache

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i))
        return [out is m.cache, out["y"], out["n"], sorted(m.cache)]

    return run


@program
def returns_rebound_history(wrap):
    """forward rebinds its history to a new list (`self.hist = self.hist + [y]`) and returns it."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.hist = []

        def forward(s, x):
            y = s.l(x)
            s.hist = s.hist + [y.detach()]
            return y, s.hist

    m = M()
    f = wrap(m)

    def run(i):
        y, h = f(inp(i))
        return [y, h is m.hist, len(h), h[-1]]

    return run


@program
def returns_list_stored_in_held_dict(wrap):
    """forward stores a new list in its cache dict and returns it read back from the dict."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cache = {}

        def forward(s, x):
            y = s.l(x)
            s.cache["last"] = [y.detach(), x.shape[0]]
            return y, s.cache["last"]

    m = M()
    f = wrap(m)

    def run(i):
        y, last = f(inp(i))
        return [y, last is m.cache["last"], last[0]]

    return run


@program
def returns_list_appended_to_held(wrap):
    """forward appends a new pair list to its log and returns the pair (read back as log[-1])."""

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.log = []

        def forward(s, x):
            y = s.l(x)
            s.log.append([y.detach()])
            return y, s.log[-1]

    m = M()
    f = wrap(m)

    def run(i):
        y, last = f(inp(i))
        return [y, last is m.log[-1], len(m.log)]

    return run


# ---- round 4, tenth batch: library namespaces patched between calls -------------------------------------------------


@program
def functional_patched_under_module(wrap):
    """F.gelu replaced between calls (an experiment), used through nn.GELU (library code calls it)."""
    m = nn.Sequential(lin(), nn.GELU())
    f = wrap(m)
    original = F.gelu

    def run(i):
        try:
            if i in (2, 3):
                F.gelu = lambda t, approximate="none": t * 0.5
            return [f(inp(i))]
        finally:
            F.gelu = original

    return run


@program
def global_forward_hook_between_calls(wrap):
    """A global module forward hook (register_module_forward_hook) registered for calls 1-2, counting calls."""
    m = nn.Sequential(lin(), nn.Tanh())
    f = wrap(m)
    seen = []

    def run(i):
        handle = None
        if i in (1, 2):
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda mod, args, out: seen.append(type(mod).__name__))
        try:
            return [f(inp(i)), list(seen)]
        finally:
            if handle is not None:
                handle.remove()

    return run


@program
def tensor_method_patched(wrap):
    """A helper method added to torch.Tensor by the user, redefined between calls."""
    l = lin()
    torch.Tensor.rt4_scale = lambda t: t * 2

    def fwd(x):
        return l(x).rt4_scale()

    f = wrap(fwd)

    def run(i):
        if i == 2:
            torch.Tensor.rt4_scale = lambda t: t * 3
        return [f(inp(i))]

    return run


@program
def hasattr_on_raising_property(wrap):
    """hasattr(self, "extra") on a property that raises AttributeError until a table entry exists."""
    table = {}

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        @property
        def extra(s):
            if "extra" not in table:
                raise AttributeError("extra")
            return table["extra"]

        def forward(s, x):
            y = s.l(x)
            return y + s.extra if hasattr(s, "extra") else y

    f = wrap(M())

    def run(i):
        if i == 2:
            table["extra"] = 2.0
        if i == 3:
            table["extra"] = -1.0
        if i == 4:
            table.clear()
        return [f(inp(i))]

    return run


@program
def getattr_default_on_object(wrap):
    """getattr(cfg, "scale", 1.0) on a plain config object that gains and loses the attribute."""

    class Cfg:
        pass

    cfg = Cfg()
    l = lin()

    def fwd(x):
        return l(x) * getattr(cfg, "scale", 1.0)

    f = wrap(fwd)

    def run(i):
        if i == 1:
            cfg.scale = 3.0
        if i == 2:
            Cfg.scale = 5.0
        if i == 3:
            del cfg.scale
        if i == 4:
            del Cfg.scale
        return [f(inp(i))]

    return run


# ---- round 4, eleventh batch: explicit regions touching the world ---------------------------------------------------


@program
def region_closure_counter(wrap):
    """A region function closing over a nonlocal counter, called three times per forward (stamped calls)."""
    l = lin()

    def make():
        n = 0

        @stampout.region
        def block(x):
            nonlocal n
            n += 1
            return l(x).tanh() * n

        return block, lambda: n

    block, count = make()

    def fwd(x):
        return block(block(block(x)))

    f = wrap(fwd)

    def run(i):
        return [f(inp(i)), count()]

    return run


@program
def region_global_dict_by_arg(wrap):
    """A region reads a global table by a string argument; the table changes between calls."""
    table = {"a": 1.0, "b": 2.0}
    l = lin()

    @stampout.region
    def block(x, key):
        return l(x).tanh() * table[key]

    def fwd(x):
        return block(block(x, "a"), "b") + block(x, "a")

    f = wrap(fwd)

    def run(i):
        if i == 2:
            table["a"] = -3.0
        return [f(inp(i))]

    return run


@program
def region_appends_to_arg_list(wrap):
    """A region appends its output to a list argument (collecting hidden states)."""
    blocks = nn.ModuleList([lin(0), lin(1), lin(2)])

    @stampout.region
    def block(layer, x, states):
        y = layer(x).tanh()
        states.append(y)
        return y

    def fwd(x):
        states = []
        for layer in blocks:
            x = block(layer, x, states)
        return x, states

    f = wrap(fwd)

    def run(i):
        y, states = f(inp(i))
        return [y, len(states), states[0]]

    return run


@program
def region_attr_store_per_layer(wrap):
    """A region method stores a per-layer statistic on self (replayed by stamped calls)."""

    class L(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.last_norm = None

        @stampout.region
        def forward(s, x):
            y = s.l(x).tanh()
            s.last_norm = y.detach().norm()
            return y

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(L(k) for k in range(3))

        def forward(s, x):
            for layer in s.layers:
                x = layer(x)
            return x

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), [layer.last_norm.clone() for layer in m.layers]]

    return run


@program
def builtin_patched_between_calls(wrap):
    """A name the program loads from builtins (a gain an instrumentation script installs there) changed between
    calls."""
    import builtins

    builtins.RT4_GAIN = 1.0
    l = lin()

    def fwd(x):
        return l(x) * RT4_GAIN  # noqa: F821 - found in builtins

    f = wrap(fwd)

    def run(i):
        if i == 2:
            builtins.RT4_GAIN = 3.0
        return [f(inp(i))]

    return run


class _Reprs:
    """A config whose __repr__/__str__ and __eq__ count their calls (stampout must not call them)."""

    def __init__(self):
        self.scale = 2.0
        self.reprs = 0
        self.eqs = 0

    def __repr__(self):
        self.reprs += 1
        return f"_Reprs({self.scale})"

    def __eq__(self, other):
        self.eqs += 1
        return other is self

    __hash__ = object.__hash__


@program
def dunder_repr_eq_counts(wrap):
    """A config object with counting __repr__/__eq__, read by forward and passed as an argument."""
    cfg = _Reprs()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cfg = cfg

        def forward(s, x, other):
            return s.l(x) * s.cfg.scale * other.scale

    f = wrap(M())
    other = _Reprs()

    def run(i):
        if i == 2:
            cfg.scale = 3.0
        return [f(inp(i), other), cfg.reprs, cfg.eqs, other.reprs, other.eqs]

    return run


class _SeqOfScales(list):
    """A list subclass counting __len__/__iter__/__getitem__ calls."""

    calls = 0

    def __len__(self):
        type(self).calls += 1
        return super().__len__()

    def __iter__(self):
        type(self).calls += 1
        return super().__iter__()

    def __getitem__(self, k):
        type(self).calls += 1
        return super().__getitem__(k)


@program
def list_subclass_dunder_counts(wrap):
    """A list subclass of scales held by the module, its dunders counting calls."""
    _SeqOfScales.calls = 0

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.scales = _SeqOfScales([1.0, 2.0])

        def forward(s, x):
            return s.l(x) * s.scales[0] * s.scales[1]

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            list.__setitem__(m.scales, 1, 4.0)
        return [f(inp(i)), _SeqOfScales.calls]

    return run


@program
def dunder_hash_input_dict(wrap):
    """A dict keyed by counting-hash objects passed as an argument, looked up by forward."""
    _CountingKey.hashes = _CountingKey.eqs = 0
    k = _CountingKey("a")
    l = lin()

    def fwd(x, table):
        return l(x) * table[k]

    f = wrap(fwd)

    def run(i):
        return [f(inp(i), {k: float(i + 1)}), _CountingKey.hashes]

    return run


@program
def dunder_hash_set_membership(wrap):
    """`key in self.allowed`, a set of counting-hash objects held by the module."""
    _CountingKey.hashes = _CountingKey.eqs = 0

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.allowed = {_CountingKey("a")}

        def forward(s, x, key):
            return s.l(x) * (2.0 if key in s.allowed else 1.0)

    f = wrap(M())
    keys = [_CountingKey("a"), _CountingKey("b")]

    def run(i):
        return [f(inp(i), keys[i % 2]), _CountingKey.hashes]

    return run


@program
def import_module_by_name(wrap):
    """importlib.import_module of a plugin name held on the module; the plugin's flag and the name change."""
    import importlib
    import sys

    for name, scale in (("rt4_plug_a", 1.0), ("rt4_plug_b", -2.0)):
        mod = types.ModuleType(name)
        mod.SCALE = scale
        sys.modules[name] = mod

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.plugin = "rt4_plug_a"

        def forward(s, x):
            return s.l(x) * importlib.import_module(s.plugin).SCALE

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            sys.modules["rt4_plug_a"].SCALE = 3.0
        if i == 3:
            m.plugin = "rt4_plug_b"
        return [f(inp(i))]

    return run


@program
def dunder_import_call(wrap):
    """__import__(name) of a module whose flag changes between calls."""
    import sys

    mod = types.ModuleType("rt4_dunder_imp")
    mod.ON = False
    sys.modules["rt4_dunder_imp"] = mod
    l = lin()

    def fwd(x):
        return l(x) * (2.0 if __import__("rt4_dunder_imp").ON else 1.0)

    f = wrap(fwd)

    def run(i):
        if i == 2:
            mod.ON = True
        return [f(inp(i))]

    return run


# ---- round 4, review batch: dict subclasses as inputs ---------------------------------------------------------------


@program
def dict_subclass_input_with_a_field(wrap):
    """A dict subclass whose own __iter__ reads a field of the instance (`d.only`), set between calls: the input's
    items are its spec, its fields are not (the trace read a copy's)."""

    class Weights(dict):
        only = None

        def __iter__(self):
            return iter([k for k in dict.__iter__(self) if self.only is None or k == self.only])

    l = lin()

    def fwd(x, d):
        for k in d:
            x = l(x) * d[k]
        return x

    f = wrap(fwd)
    d = Weights(a=1.0, b=2.0)

    def run(i):
        if i == 2:
            d.only = "a"
        if i == 3:
            d.only = "b"
        return [f(inp(i), d)]

    return run


@program
def dict_subclass_input_iterating_in_its_own_order(wrap):
    """A dict subclass iterating its keys sorted (not in insertion order), read only: the caller's dict must come back
    as it was (its values were swapped between keys: a replayed whole-dict store zipped the class's key order with
    dict's value order)."""

    class Sorted(dict):
        def __iter__(self):
            return iter(sorted(dict.keys(self), reverse=True))

    def fwd(x, d):
        for k in d:
            x = x * 10 + d[k]
        return x

    f = wrap(fwd)
    d = Sorted(b=2.0, c=0.5, a=3.0)

    def run(i):
        if i == 3:
            dict.__setitem__(d, "d", 1.0)
        return [f(inp(i), d), dict(dict.items(d)), list(dict.keys(d))]

    return run


@program
def import_bound_in_a_cell(wrap):
    """`import m` in a function whose nested function reads m too (the import binds a cell, not a local): m's flag
    changes between calls, then sys.modules gets another m."""
    import sys

    def plugin(scale):
        mod = types.ModuleType("rt4_cell_import")
        mod.SCALE = scale
        sys.modules["rt4_cell_import"] = mod
        return mod

    mod = plugin(2.0)
    l = lin()

    def fwd(x):
        import rt4_cell_import

        def scaled(y):
            return y * rt4_cell_import.SCALE

        return scaled(l(x)) + rt4_cell_import.SCALE

    f = wrap(fwd)

    def run(i):
        if i == 2:
            mod.SCALE = 3.0
        if i == 4:
            plugin(7.0)
        return [f(inp(i))]

    return run


@program
def module_list_subclass_gains_iter(wrap):
    """A ModuleList subclass of the user's, iterated in forward; between calls its class gains an `__iter__` that
    walks the layers in reverse."""

    class Layers(nn.ModuleList):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = Layers(lin(i) for i in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) * 0.5
            return x

    m = Model()
    f = wrap(m)

    def run(i):
        if i == 2:
            Layers.__iter__ = lambda self: iter(list(self._modules.values())[::-1])
        with torch.no_grad():
            return [f(inp(i))]

    return run


@program
def dict_subclass_attribute_gains_getitem(wrap):
    """A dict subclass of the user's held by the model and read item by item in forward; between calls its class gains
    a `__getitem__`, then an item is written past the class's methods."""

    class Table(dict):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = lin()
            self.table = Table(a=1.0, b=2.0)

        def forward(self, x):
            for k in self.table:
                x = self.l(x) * self.table[k]
            return x

    m = Model()
    f = wrap(m)

    def run(i):
        if i == 2:
            Table.__getitem__ = lambda self, k: 0.5
        if i == 3:
            dict.__setitem__(m.table, "c", 3.0)
        with torch.no_grad():
            return [f(inp(i))]

    return run
