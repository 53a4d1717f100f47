# ruff: noqa: B006, B019, B028, E741 (the programs are written as users write them)
"""Ordinary programs that touch the world from the traced code (memo caches, random/NumPy, time, os.environ,
globals, iterators, weak references, class attributes, closures, properties, autograd hooks, checkpointing, custom
autograd Functions, in-place updates, grad modes, autocast, torch.cond, logging, warnings, exceptions, contextvars,
thread-locals),
for tests/test_redteam3.py. Each `make(wrap)` builds a fresh world (`wrap` is the identity for eager, or compiles) and
returns `run(i)`: call i, with the changes a user makes between calls, returning what is compared with eager (outputs,
gradients, the caller's objects)."""

from __future__ import annotations

import collections
import contextvars
import copy
import dataclasses
import functools
import itertools
import json
import logging
import os
import random
import tempfile
import threading
import time
import warnings
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from redteam_battery import grads, inp, lin, registry
from torch import nn

import stampout

PROGRAMS, program = registry()


# 1 lru_cache mask


@functools.cache
def _mask(n):
    return torch.triu(torch.ones(n, n), 1).bool()


@program
def lru_cache_mask(wrap):
    _mask.cache_clear()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            h = s.l(x)
            att = h @ h.T
            return att.masked_fill(_mask(x.shape[0]), 0.0)

    m = M()
    f = wrap(m)

    def run(i):
        x = inp(i, n=[2, 3, 2, 3][i % 4])
        return [f(x)]

    return run


# 2 memo dict keyed by shape on the module


@program
def memo_dict_on_module(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s._pos = {}

        def forward(s, x):
            n = x.shape[0]
            if n not in s._pos:
                s._pos[n] = torch.arange(n, dtype=torch.float32)[:, None]
            return s.l(x) + s._pos[n]

    m = M()
    f = wrap(m)

    def run(i):
        x = inp(i, n=[2, 3, 2, 3][i % 4])
        return [f(x), sorted(m._pos), [v.clone() for _, v in sorted(m._pos.items())]]

    return run


# 3 layerdrop with random.random


@program
def layerdrop_random(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)

        def forward(s, x):
            x = s.a(x)
            if s.training and random.random() < 0.5:
                return x
            return s.b(x)

    m = M()
    f = wrap(m)
    random.seed(0)

    def run(i):
        return [f(inp(i)), random.random()]

    return run


# 4 numpy noise


@program
def numpy_noise(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            noise = torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
            return s.l(x + 0.1 * noise)

    m = M()
    f = wrap(m)
    np.random.seed(0)

    def run(i):
        return [f(inp(i)), float(np.random.rand())]

    return run


# 5 time stamps appended


@program
def time_log(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.stamps = []

        def forward(s, x):
            s.stamps.append(time.perf_counter())
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i))
        ok = len(set(m.stamps)) == len(m.stamps) and m.stamps == sorted(m.stamps)
        return [out, len(m.stamps), ok]

    return run


# 6 os.environ flag


@program
def environ_flag(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            if os.environ.get("S3_DOUBLE") == "1":
                y = y * 2
            return y

    m = M()
    f = wrap(m)
    os.environ.pop("S3_DOUBLE", None)

    def run(i):
        if i == 2:
            os.environ["S3_DOUBLE"] = "1"
        if i == 4:
            os.environ["S3_DOUBLE"] = "0"
        return [f(inp(1))]

    return run


# 7 global counter used in computation


CALLS = 0


@program
def global_counter(wrap):
    global CALLS
    CALLS = 0

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            global CALLS
            CALLS += 1
            return s.l(x) * CALLS

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1)), CALLS]

    return run


# 8 history list of detached tensors


@program
def history_append(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.history = []

        def forward(s, x):
            y = s.l(x)
            s.history.append(y.detach())
            return y

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i)), [h.clone() for h in m.history]]

    return run


# 9 module holds an iterator of scales


@program
def iterator_scales(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.sched = iter([1.0, 0.5, 0.25, 0.125, 2.0, 3.0])

        def forward(s, x):
            return s.l(x) * next(s.sched)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


# 10 itertools.count global step


STEP = itertools.count()


@program
def itertools_count(wrap):
    global STEP
    STEP = itertools.count()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            k = next(STEP)
            return s.l(x) + k

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


# 11 weakref to another module


@program
def weakref_other(wrap):
    class M(nn.Module):
        def __init__(s, other):
            super().__init__()
            s.l = lin()
            s._other = weakref.ref(other)

        def forward(s, x):
            o = s._other()
            return s.l(x) if o is None else s.l(x) + o.weight.sum()

    other = lin(5)
    other2 = lin(6)
    m = M(other)
    f = wrap(m)

    def run(i):
        if i == 2:
            m._other = weakref.ref(other2)
        return [f(inp(1))]

    return run


# 12 class attribute counter


@program
def class_attr_counter(wrap):
    class M(nn.Module):
        count = 0

        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            type(s).count += 1
            return s.l(x) * type(s).count

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1)), M.count]

    return run


# 13 closure nonlocal counter


@program
def closure_nonlocal(wrap):
    l = lin()

    def make():
        n = 0

        def step(x):
            nonlocal n
            n += 1
            return l(x) * n

        return step

    f = wrap(make())

    def run(i):
        return [f(inp(1))]

    return run


# 14 property with side effect


@program
def property_side_effect(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s._s = 2.0
            s.reads = 0

        @property
        def scale(s):
            s.reads += 1
            return s._s

        def forward(s, x):
            return s.l(x) * s.scale

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m._s = 3.0
        return [f(inp(1)), m.reads]

    return run


# 15 register_hook scaling gradients


@program
def tensor_hook_scale(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)

        def forward(s, x):
            h = s.a(x)
            if h.requires_grad:
                h.register_hook(lambda g: g * 3)
            return s.b(h)

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


# 16 register_hook recording grads into a list


@program
def tensor_hook_record(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)
            s.seen = []

        def forward(s, x):
            h = s.a(x)
            h.register_hook(lambda g: s.seen.append(g.clone()))
            return s.b(h)

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m), [g.clone() for g in m.seen]]

    return run


# 17 checkpoint


@program
def checkpoint_block(wrap):
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)

        def forward(s, x):
            h = checkpoint(lambda t: torch.tanh(s.a(t)), x, use_reentrant=False)
            return s.b(h)

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        x = inp(i, grad=True)
        out = f(x)
        out.sum().backward()
        return [out, grads(m), x.grad]

    return run


# 18 custom autograd.Function with ctx state


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


@program
def autograd_function_ctx(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)
            s.gscale = 0.5

        def forward(s, x):
            return s.b(ScaleGrad.apply(s.a(x), s.gscale))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.gscale = 4.0
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


# 19 attributes set in forward


@program
def attrs_set_in_forward(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            s.last_shape = tuple(x.shape)
            s.last_out = y.detach()
            s.last_norm = y.detach().norm()
            return y

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i, n=[2, 3][i % 2]))
        return [out, m.last_shape, m.last_out.clone(), m.last_norm.clone()]

    return run


# 20 in-place on input and param under no_grad


@program
def inplace_input_and_param(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            x.mul_(2)
            with torch.no_grad():
                s.l.bias.add_(0.1)
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        x = inp(i)
        out = f(x)
        return [out, x, m.l.bias.detach().clone()]

    return run


# 21 dataclass output


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor | None = None
    n: int = 0


@program
def dataclass_output(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.k = 0

        def forward(s, x):
            s.k += 1
            y = s.l(x)
            return Out(y, y.mean() if s.k % 2 else None, s.k)

    m = M()
    f = wrap(m)

    def run(i):
        o = f(inp(i))
        return [type(o).__name__, o.logits, o.aux, o.n]

    return run


# 22 nested regions with a counter


@program
def nested_regions(wrap):
    class Inner(nn.Module):
        def __init__(s, k):
            super().__init__()
            s.l = lin(k)
            s.calls = 0

        @stampout.region
        def forward(s, x):
            s.calls += 1
            return torch.relu(s.l(x))

    class Outer(nn.Module):
        def __init__(s):
            super().__init__()
            s.blocks = nn.ModuleList(Inner(k) for k in range(3))

        @stampout.region
        def forward(s, x):
            for b in s.blocks:
                x = b(x) + x
            return x

    m = Outer()
    f = wrap(m)

    def run(i):
        out = f(inp(i))
        return [out, [b.calls for b in m.blocks]]

    return run


# 23 threading.local


_TLS = threading.local()


@program
def thread_local_scale(wrap):
    _TLS.scale = 1.0

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * getattr(_TLS, "scale", 1.0)

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            _TLS.scale = 5.0
        return [f(inp(1))]

    return run


# 24 contextvars


_CV = contextvars.ContextVar("s3_scale", default=1.0)


@program
def contextvar_scale(wrap):
    _CV.set(1.0)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * _CV.get()

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            _CV.set(7.0)
        return [f(inp(1))]

    return run


# 25 logging in forward


_LOG = logging.getLogger("s3.model")


@program
def logging_in_forward(wrap):
    class H(logging.Handler):
        def __init__(s):
            super().__init__()
            s.msgs = []

        def emit(s, r):
            s.msgs.append(r.getMessage())

    h = H()
    _LOG.handlers[:] = [h]
    _LOG.setLevel(logging.INFO)
    _LOG.propagate = False

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            _LOG.info("forward with shape %s", tuple(x.shape))
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i, n=[2, 3][i % 2]))
        return [out, list(h.msgs)]

    return run


# 26 warnings in forward


@program
def warnings_in_forward(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            if x.shape[0] > 2:
                warnings.warn("big batch", UserWarning)
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = f(inp(i, n=[2, 3][i % 2]))
        return [out, [str(r.message) for r in w if "big batch" in str(r.message)]]

    return run


# 27 exception caught in forward (config lookup)


@program
def exception_caught(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.cfg = {}

        def forward(s, x):
            try:
                k = s.cfg["scale"]
            except KeyError:
                k = 1.0
            return s.l(x) * k

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.cfg["scale"] = 3.0
        if i == 3:
            m.cfg = {"scale": 0.5}
        return [f(inp(1))]

    return run


# 28 autocast inside forward


@program
def autocast_inside(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.m = lin(3)

        def forward(s, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = s.l(x)
            return s.m(y.float())

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


# 29 no_grad / enable_grad / inference_mode inside


@program
def grad_modes_inside(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.t = lin(4)

        def forward(s, x):
            with torch.no_grad():
                target = s.t(x)
            with torch.enable_grad():
                y = s.l(x)
            return ((y - target) ** 2).mean(), target

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        if i == 2:
            with torch.no_grad():
                loss, t = f(inp(i))
            return [loss, t, loss.requires_grad]
        loss, t = f(inp(i))
        loss.backward()
        return [loss, t, grads(m)]

    return run


@program
def inference_mode_inside(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.stats = torch.zeros(4)

        def forward(s, x):
            with torch.inference_mode():
                s.stats = s.stats + x.mean(0)
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i))
        return [out, m.stats.clone()]

    return run


# 30 torch.cond


@program
def torch_cond(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            return torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i) * (1 if i % 2 else -5))]

    return run


# 31 dropout with torch RNG


@program
def dropout_rng(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.d = nn.Dropout(0.5)

        def forward(s, x):
            return s.d(s.l(x))

    m = M()
    f = wrap(m)
    torch.manual_seed(0)

    def run(i):
        return [f(inp(i)), torch.rand(2)]

    return run


# 33 global dict stats


STATS = collections.Counter()


@program
def global_counter_dict(wrap):
    STATS.clear()

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            STATS["calls"] += 1
            STATS["rows"] += x.shape[0]
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i, n=[2, 3][i % 2]))
        return [out, dict(STATS)]

    return run


# 36 id(x)-keyed memo


@program
def id_keyed_memo(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.memo = {}

        def forward(s, x):
            k = id(x)
            if k in s.memo:
                return s.memo[k]
            y = s.l(x)
            s.memo[k] = y
            return y

    m = M()
    f = wrap(m)
    xs = [inp(0), inp(1)]

    def run(i):
        x = xs[[0, 0, 1, 1, 0][i % 5]]
        if i == 3:
            with torch.no_grad():
                m.l.weight.mul_(2)
        return [f(x)]

    return run


# 41 torch.Generator held on module


@program
def module_generator(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.gen = torch.Generator().manual_seed(3)

        def forward(s, x):
            return s.l(x) + torch.randn(x.shape, generator=s.gen)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


# 42 datetime in forward


@program
def datetime_in_forward(wrap):
    import datetime

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.when = []

        def forward(s, x):
            s.when.append(datetime.datetime.now())
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        out = f(inp(i))
        return [out, len(m.when), len(set(m.when)) == len(m.when)]

    return run


# 43 functools.cache method on class with self (memo on instance)


@program
def cached_method_rope(wrap):
    class Rope(nn.Module):
        def __init__(s):
            super().__init__()
            s.base = 10000.0
            s.cache = {}

        def freqs(s, n, d):
            key = (n, d)
            if key not in s.cache:
                inv = 1.0 / (s.base ** (torch.arange(0, d, 2).float() / d))
                s.cache[key] = torch.outer(torch.arange(n).float(), inv)
            return s.cache[key]

        def forward(s, x):
            f = s.freqs(x.shape[0], x.shape[1])
            return x * f.cos().repeat(1, 2) + x * f.sin().repeat(1, 2)

    m = Rope()
    f = wrap(m)

    def run(i):
        if i == 3:
            m.base = 500.0
            m.cache.clear()
        return [f(inp(i, n=[2, 3][i % 2]))]

    return run


# 49 random.Random instance held


@program
def random_instance(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.rng = random.Random(0)

        def forward(s, x):
            return s.l(x) * s.rng.uniform(0.5, 1.5)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


# 50 partial / lambda activation swapped


@program
def activation_swapped(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.act = functools.partial(F.leaky_relu, negative_slope=0.1)

        def forward(s, x):
            return s.act(s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.act = functools.partial(F.leaky_relu, negative_slope=0.3)
        if i == 3:
            m.act = lambda t: t * 3
        return [f(inp(1))]

    return run


# 52 enable_grad inside no_grad caller


@program
def mutable_default_arg(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x, seen=[]):
            seen.append(x.shape[0])
            return s.l(x) * len(seen)

    m = M()
    f = wrap(m)
    M.forward.__defaults__[0].clear()

    def run(i):
        return [f(inp(i)), list(M.forward.__defaults__[0])]

    return run


@program
def dict_batch_written(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, batch):
            y = s.l(batch["x"])
            batch["logits"] = y
            batch["loss"] = y.pow(2).mean()
            batch.setdefault("steps", 0)
            return batch["loss"]

    m = M()
    f = wrap(m)

    def run(i):
        b = {"x": inp(i)}
        if i % 2:
            b["steps"] = 5
        out = f(b)
        return [out, sorted(b), b["logits"], b["steps"]]

    return run


@program
def retain_grad_debug(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)

        def forward(s, x):
            h = s.a(x)
            h.retain_grad()
            s.h = h
            return s.b(h)

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m), m.h.grad]

    return run


@program
def gradient_penalty(wrap):
    class D(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = nn.Linear(4, 1)

        def forward(s, x):
            x = x.requires_grad_(True)
            y = s.b(torch.tanh(s.a(x))).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            return y + ((g.norm(dim=1) - 1) ** 2).mean()

    m = D()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.backward()
        return [out, grads(m)]

    return run


@program
def actnorm_data_init(wrap):
    class ActNorm(nn.Module):
        def __init__(s):
            super().__init__()
            s.loc = nn.Parameter(torch.zeros(4))
            s.scale = nn.Parameter(torch.ones(4))
            s.initialized = False

        def forward(s, x):
            if not s.initialized:
                with torch.no_grad():
                    s.loc.copy_(-x.mean(0))
                    s.scale.copy_(1 / (x.std(0) + 1e-6))
                s.initialized = True
            return (x + s.loc) * s.scale

    m = nn.Sequential(lin(), ActNorm())
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i, n=3))
        out.sum().backward()
        return [out, grads(m)]

    return run


@program
def batchnorm_toggle(wrap):
    m = nn.Sequential(lin(), nn.BatchNorm1d(4), nn.ReLU())
    f = wrap(m)

    def run(i):
        m.train(i % 3 != 2)
        m.zero_grad(set_to_none=True)
        out = f(inp(i, n=3))
        out.sum().backward()
        return [out, grads(m), {k: v.clone() for k, v in m.state_dict().items()}]

    return run


@program
def kv_cache_cat(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.k = lin()
            s.cache = None

        def forward(s, x):
            k = s.k(x)
            s.cache = k if s.cache is None else torch.cat([s.cache, k])
            return torch.softmax(x @ s.cache.T, -1) @ s.cache

    m = M()
    f = wrap(m)

    def run(i):
        with torch.no_grad():
            if i == 3:
                m.cache = None
            return [f(inp(i, n=1)), m.cache.clone()]

    return run


@program
def autograd_function_global_count(wrap):
    counts = {"fwd": 0, "bwd": 0}

    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            counts["fwd"] += 1
            ctx.save_for_backward(x)
            return x.clamp(-1, 1)

        @staticmethod
        def backward(ctx, g):
            counts["bwd"] += 1
            (x,) = ctx.saved_tensors
            return g * (x.abs() <= 1)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return Clip.apply(s.l(x))

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m), dict(counts)]

    return run


def stack(layer_cls, n=3, **kw):
    class Stack(nn.Module):
        def __init__(s):
            super().__init__()
            s.layers = nn.ModuleList(layer_cls(i, **kw) for i in range(n))

        def forward(s, x):
            for l in s.layers:
                x = l(x)
            return x

    return Stack()


TRACE_LOG = []


@program
def rg_calls_counter(wrap):
    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.calls = 0
            s.l = lin(i)

        def forward(s, x):
            s.calls += 1
            return torch.tanh(s.l(x)) * (1 + 0.1 * s.calls)

    m = stack(L)
    f = wrap(m)

    def run(i):
        return [f(inp(i)), [l.calls for l in m.layers]]

    return run


SCALES = {0: 1.0, 1: 2.0, 2: 3.0}


@functools.cache
def _freq(i, n):
    return torch.arange(n, dtype=torch.float32) * (i + 1)


@program
def rg_lru_by_idx(wrap):
    _freq.cache_clear()

    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.i = i
            s.l = lin(i)

        def forward(s, x):
            return torch.tanh(s.l(x)) + _freq(s.i, x.shape[-1])

    m = stack(L)
    f = wrap(m)

    def run(i):
        return [f(inp(i))]

    return run


@program
def rg_tensor_hook(wrap):
    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.i = i
            s.l = lin(i)

        def forward(s, x):
            h = s.l(x)
            if h.requires_grad:
                h.register_hook(lambda g: g * (s.i + 1))
            return torch.tanh(h)

    m = stack(L)
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m)]

    return run


@program
def rg_layerdrop(wrap):
    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.l = lin(i)

        def forward(s, x):
            if s.training and random.random() < 0.3:
                return x
            return torch.tanh(s.l(x))

    m = stack(L, n=4)
    f = wrap(m)
    random.seed(1)

    def run(i):
        return [f(inp(i)), random.random()]

    return run


@program
def rg_checkpoint(wrap):
    from torch.utils.checkpoint import checkpoint

    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.l = lin(i)

        def forward(s, x):
            return checkpoint(lambda t: torch.tanh(s.l(t)), x, use_reentrant=False)

    m = stack(L)
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        x = inp(i, grad=True)
        out = f(x)
        out.sum().backward()
        return [out, grads(m), x.grad]

    return run


@program
def rg_dropout(wrap):
    class L(nn.Module):
        def __init__(s, i):
            super().__init__()
            s.l = lin(i)
            s.d = nn.Dropout(0.3)

        def forward(s, x):
            return s.d(torch.tanh(s.l(x)))

    m = stack(L)
    f = wrap(m)
    torch.manual_seed(0)

    def run(i):
        m.train(i != 3)
        return [f(inp(i)), torch.rand(1)]

    return run


@program
def rg_shared_cfg(wrap):
    class Cfg:
        eps = 1e-5
        act = "tanh"

    cfg = Cfg()

    class L(nn.Module):
        def __init__(s, i, cfg=cfg):
            super().__init__()
            s.l = lin(i)
            s.cfg = cfg

        def forward(s, x):
            h = s.l(x)
            h = torch.tanh(h) if s.cfg.act == "tanh" else torch.relu(h)
            return h / (h.norm() + s.cfg.eps)

    m = stack(L)
    f = wrap(m)

    def run(i):
        if i == 2:
            cfg.act = "relu"
        if i == 3:
            Cfg.eps = 1.0
        return [f(inp(i))]

    return run


@program
def raises_after_side_effect(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.calls = 0
            s.log = []

        def forward(s, x):
            s.calls += 1
            s.log.append(x.shape[0])
            if x.shape[0] > 2:
                raise ValueError("batch too big")
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        try:
            out = f(inp(i, n=[2, 3, 2, 3, 2][i]))
        except ValueError as e:
            out = str(e)
        return [out, m.calls, list(m.log)]

    return run


@program
def global_grad_mode_change(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.saw = []

        def forward(s, x):
            s.saw.append(torch.is_grad_enabled())
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(i % 2 == 0)
        try:
            out = f(inp(1))
        finally:
            torch.set_grad_enabled(prev)
        return [out, out.requires_grad, list(m.saw)]

    return run


@program
def stale_weight_cache(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s._wt = None

        def forward(s, x):
            if not s.training:
                if s._wt is None:
                    s._wt = s.l.weight.t().contiguous()
                return x @ s._wt + s.l.bias
            s._wt = None
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        m.train(i in (0, 3))
        with torch.no_grad():
            if i in (2, 4):
                m.l.weight.add_(1.0)
            return [f(inp(1))]

    return run


@program
def lru_method_self(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        @functools.lru_cache(maxsize=4)
        def table(s, n):
            return torch.arange(n, dtype=torch.float32)[:, None] * s.l.bias.detach()

        def forward(s, x):
            return s.l(x) + s.table(x.shape[0])

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(i, n=[2, 3][i % 2]))]

    return run


@program
def generator_of_tensors(wrap):
    def noise():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, generator=g)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.src = noise()

        def forward(s, x):
            return s.l(x) + next(s.src)

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


@program
def ema_teacher_lazy(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.student = lin()
            s.teacher = None

        def forward(s, x):
            if s.teacher is None:
                s.teacher = copy.deepcopy(s.student).requires_grad_(False)
            with torch.no_grad():
                for pt, ps in zip(s.teacher.parameters(), s.student.parameters()):
                    pt.mul_(0.9).add_(0.1 * ps)
            return s.student(x) - s.teacher(x)

    m = M()
    f = wrap(m)

    def run(i):
        m.zero_grad(set_to_none=True)
        out = f(inp(i))
        out.sum().backward()
        return [out, grads(m.student), {k: v.clone() for k, v in m.teacher.state_dict().items()}]

    return run


@program
def prompt_bank_index(wrap):
    bank = [torch.zeros(4), torch.ones(4)]

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x, k):
            return s.l(x) + bank[k]

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            bank.append(torch.full((4,), 5.0))
        if i == 3:
            bank[1] = torch.full((4,), -2.0)
        return [f(inp(1), [0, 1, 2, 1, 2][i])]

    return run


@program
def random_choice_path(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)

        def forward(s, x):
            branch = random.choice([s.a, s.b])
            return branch(x)

    m = M()
    f = wrap(m)
    random.seed(3)

    def run(i):
        return [f(inp(1))]

    return run


@program
def np_random_choice_scale(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.rng = np.random.default_rng(0)

        def forward(s, x):
            return s.l(x) * float(s.rng.uniform(0.5, 1.5))

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1))]

    return run


_CFG = os.path.join(tempfile.gettempdir(), f"stampout_redteam3_cfg_{os.getpid()}.json")


@program
def reads_config_file(wrap):
    with open(_CFG, "w") as fh:
        json.dump({"scale": 1.0}, fh)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            with open(_CFG) as fh:
                cfg = json.load(fh)
            return s.l(x) * cfg["scale"]

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            with open(_CFG, "w") as fh:
                json.dump({"scale": 4.0}, fh)
        return [f(inp(1))]

    return run


_FLAG = os.path.join(tempfile.gettempdir(), f"stampout_redteam3_flag_{os.getpid()}")


@program
def path_exists_branch(wrap):
    if os.path.exists(_FLAG):
        os.remove(_FLAG)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            if os.path.exists(_FLAG):
                y = y * 0
            return y

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            open(_FLAG, "w").close()
        if i == 4:
            os.remove(_FLAG)
        return [f(inp(1))]

    return run


@program
def shuffle_order(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList(lin(k) for k in range(3))
            s.order = [0, 1, 2]

        def forward(s, x):
            random.shuffle(s.order)
            for k in s.order:
                x = torch.tanh(s.ls[k](x))
            return x

    m = M()
    f = wrap(m)
    random.seed(5)

    def run(i):
        return [f(inp(1)), list(m.order)]

    return run


@program
def set_pop_queue(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.todo = {3, 1, 2}

        def forward(s, x):
            k = s.todo.pop() if s.todo else 0
            return s.l(x) * k

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1)), sorted(m.todo)]

    return run


@program
def deque_popleft(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.q = collections.deque([1.0, 2.0, 3.0, 4.0, 5.0])

        def forward(s, x):
            k = s.q.popleft()
            s.q.append(k)
            return s.l(x) * k

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1)), list(m.q)]

    return run


@program
def time_budget_branch(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = lin(1)
            s.b = lin(2)
            s.deadline = None

        def forward(s, x):
            y = s.a(x)
            if s.deadline is None or time.monotonic() < s.deadline:
                y = s.b(y)
            return y

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            m.deadline = time.monotonic() - 1.0
        if i == 3:
            m.deadline = time.monotonic() + 100.0
        return [f(inp(1))]

    return run


@program
def dict_popitem(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.pending = {"a": 1.0, "b": 2.0, "c": 3.0}

        def forward(s, x):
            k = s.pending.popitem()[1] if s.pending else 0.0
            return s.l(x) * k

    m = M()
    f = wrap(m)

    def run(i):
        return [f(inp(1)), dict(m.pending)]

    return run


@program
def env_int_parsed(wrap):
    os.environ["S3_LAYERS"] = "1"

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.ls = nn.ModuleList(lin(k) for k in range(3))

        def forward(s, x):
            for l in s.ls[: int(os.getenv("S3_LAYERS", "3"))]:
                x = torch.tanh(l(x))
            return x

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            os.environ["S3_LAYERS"] = "3"
        if i == 4:
            del os.environ["S3_LAYERS"]
        return [f(inp(1))]

    return run


@program
def data_ptr_memo(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.memo = {}

        def forward(s, x):
            k = (x.data_ptr(), tuple(x.shape))
            if k not in s.memo:
                s.memo[k] = s.l(x).detach()
            return s.memo[k] + 0

    m = M()
    f = wrap(m)
    xs = [inp(0), inp(1)]

    def run(i):
        if i == 3:
            with torch.no_grad():
                m.l.weight.mul_(2)
        return [f(xs[[0, 0, 1, 0, 1][i]]), len(m.memo)]

    return run


@program
def initial_seed_rng(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            r = random.Random(torch.initial_seed())
            return s.l(x) * r.random()

    m = M()
    f = wrap(m)

    def run(i):
        if i == 2:
            torch.manual_seed(99)
        return [f(inp(1))]

    return run


@program
def deterministic_branch(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            return s.l(x) * (3.0 if torch.are_deterministic_algorithms_enabled() else 1.0)

    m = M()
    f = wrap(m)

    def run(i):
        torch.use_deterministic_algorithms(i in (2, 3))
        try:
            return [f(inp(1))]
        finally:
            torch.use_deterministic_algorithms(False)

    return run


@program
def autocast_enabled_branch(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()

        def forward(s, x):
            y = s.l(x)
            if torch.is_autocast_enabled("cpu"):
                y = y.float() * 2
            return y

    m = M()
    f = wrap(m)

    def run(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i in (2, 3)):
            out = f(inp(1))
        return [out, out.dtype]

    return run


@program
def inference_mode_branch(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.n = 0

        def forward(s, x):
            if not torch.is_inference_mode_enabled():
                s.n += 1
            return s.l(x)

    m = M()
    f = wrap(m)

    def run(i):
        if i in (1, 3):
            with torch.inference_mode():
                out = f(inp(1))
        else:
            out = f(inp(1))
        return [out.clone(), m.n]

    return run


@program
def rng_state_roundtrip(wrap):
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.l = lin()
            s.saved = None

        def forward(s, x):
            s.saved = torch.get_rng_state()
            return torch.nn.functional.dropout(s.l(x), 0.5)

    m = M()
    f = wrap(m)
    torch.manual_seed(0)

    def run(i):
        out = f(inp(1))
        return [out, m.saved.clone(), torch.rand(1)]

    return run
