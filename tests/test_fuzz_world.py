"""Differential fuzzing of the world outside the watched objects (SPEC §3), in the style of
test_fuzz_soundness.py.

Each example generates the source of one world (its own module globals, memo caches and classes): a stack of
2-4 region layers whose forward makes a random list of *world effects* — memo caches of every kind
(`functools.lru_cache`/`cache` helpers, module-level dict and list memos, a class-attribute dict, a
`cached_property`), stores outside the watched objects (a namespace module's attribute, a `global`), Python
and NumPy RNG draws, `time.time`, `uuid.uuid4`, `next` on an iterator made outside, gradient hooks registered
in forward, module backward hooks registered before or after compile, a class-attribute counter, a list
inside a global dict, `WeakKeyDictionary` and dtype-keyed memos, `saved_tensors_hooks` in forward, and pure
calls. Two identical worlds are built; the reference runs eagerly, the other through `stampout.capture` or
`stampout.compile` (eager or aot_eager backend) over several calls with different batch sizes. Every call
must equal eager — outputs, gradients, the memo contents, the stored values, the RNG states — or stampout
must refuse with a StampoutError (only `capture` of a model with module backward hooks or saved-tensor hooks may).
"""

from __future__ import annotations

import functools
import linecache
import math
import random
import textwrap
import time
import types
import uuid
import weakref

import numpy as np
import torch
from fuzzing import examples
from helpers import tree_assert_close
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import stampout

D = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}

EFFECTS = {
    "lru": "h = h + lru_table(D)",
    "cache": "h = h + cache_table(D)",
    "dict_memo": "if D not in MEMO:\n    MEMO[D] = torch.ones(D) * 3\nh = h + MEMO[D]",
    "list_memo": "if not LMEMO:\n    LMEMO.append(torch.ones(D) * 0.25)\nh = h + LMEMO[0]",
    "class_memo": "if D not in self._masks:\n    self._masks[D] = torch.ones(D) * 4\nh = h + self._masks[D]",
    "cached_property": "h = h + self.scale",
    "namespace_store": "metrics.LAST = x.shape[0]",
    "global_store": "LAST_SUM = x.sum()",
    "py_random": "if random.random() < 0.5:\n    h = h * -1.0",
    "np_random": "if np.random.rand() < 0.5:\n    h = h * -1.0",
    "time": "h = h * (1.0 + 0.0 * (time.time() % 1))",
    "uuid": "h = h * (1.0 + 0.0 * (uuid.uuid4().int % 2))",
    "iterator": "h = h * (1.0 + 0.0 * (next(STREAM) % 2))",
    "tensor_hook": "h.register_hook(lambda g: g * -2.0)",
    "pure": "h = h * math.sqrt(len('ab') ** 2) / max(1, min(2, 3))",
    "class_counter": "type(self).CALLS += 1",
    "nested_list": "NESTED['rows'].append(x.shape[0])",
    "weak_memo": "m = WMEMO.get(self)\nif m is None:\n    m = WMEMO[self] = torch.ones(D) * 1.5\nh = h + m",
    "dtype_memo": ("if (D, x.dtype) not in DMEMO:\n    DMEMO[(D, x.dtype)] = torch.ones(D) * 0.75\n"
                   "h = h + DMEMO[(D, x.dtype)]"),
    "saved_hooks": "with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):\n    h = h * h",
}

MODULE_SRC = """
metrics = types.ModuleType("metrics")
metrics.LAST = None
MEMO = {}
LMEMO = []
LAST_SUM = None
STREAM = iter(range(10**6))
NESTED = {"rows": []}
WMEMO = weakref.WeakKeyDictionary()
DMEMO = {}


@functools.lru_cache(maxsize=None)
def lru_table(n):
    return torch.arange(n, dtype=torch.float32) / 10


@functools.cache
def cache_table(n):
    return torch.ones(n) * 0.5


class Layer(nn.Module):
    _masks = {}
    CALLS = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    @functools.cached_property
    def scale(self):
        return torch.ones(D) * 2

    @stampout.region
    def forward(self, x):
{globals_line}        h = self.fc(x)
{body}
        return x + torch.tanh(h)
"""

_COUNT = [0]


def build_world(effects: list[str], n_layers: int) -> types.SimpleNamespace:
    body = textwrap.indent("\n".join(EFFECTS[e] for e in effects) or "pass", " " * 8)
    globals_line = "        global LAST_SUM\n" if "global_store" in effects else ""
    src = MODULE_SRC.replace("{globals_line}", globals_line).replace("{body}", body)
    _COUNT[0] += 1
    filename = f"<stampout-world-fuzz-{_COUNT[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    g = {"__name__": f"world_fuzz_{_COUNT[0]}", "torch": torch, "nn": nn, "stampout": stampout, "functools": functools,
         "types": types, "random": random, "np": np, "time": time, "uuid": uuid, "math": math, "D": D,
         "weakref": weakref}
    exec(compile(src, filename, "exec"), g)  # noqa: S102 - a generated world, on purpose
    torch.manual_seed(0)
    model = nn.Sequential(*[g["Layer"]() for _ in range(n_layers)])
    return types.SimpleNamespace(g=g, model=model, src=src)


def world_state(w: types.SimpleNamespace) -> list:
    g = w.g
    return [dict(g["MEMO"]), list(g["LMEMO"]), dict(g["Layer"]._masks), g["metrics"].LAST, g["LAST_SUM"],
            g["Layer"].CALLS, list(g["NESTED"]["rows"]), list(g["WMEMO"].values()), list(g["DMEMO"].values())]


def fakes_in(value, depth: int = 0) -> bool:
    if isinstance(value, (FakeTensor, torch.SymInt, torch.SymFloat)):
        return True
    if depth > 3:
        return False
    if isinstance(value, dict):
        return any(fakes_in(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(fakes_in(v, depth + 1) for v in value)
    if isinstance(value, nn.Module):
        return any(fakes_in(v, depth + 1) for m in value.modules() for v in vars(m).values())
    return False


def _hook(w: types.SimpleNamespace) -> None:
    w.model[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))


def _input(rows: int) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(rows)).requires_grad_(True)


def _seed(seed: int) -> tuple:
    random.seed(seed)
    np.random.seed(seed)
    return random.getstate(), np.random.get_state()[1].tolist()


def _rng() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist()


def _call(run, w: types.SimpleNamespace, rows: int, seed: int | None) -> tuple:
    for p in w.model.parameters():
        p.grad = None
    if seed is not None:
        _seed(seed)
    x = _input(rows)
    out = run(x)
    (out ** 2).sum().backward()
    grads = {n: p.grad for n, p in w.model.named_parameters()}
    return out.detach(), x.grad, grads, world_state(w)


@st.composite
def worlds(draw: st.DrawFn) -> dict:
    return {
        "effects": draw(st.lists(st.sampled_from(sorted(EFFECTS)), min_size=1, max_size=4, unique=True)),
        "layers": draw(st.integers(2, 4)),
        "mode": draw(st.sampled_from(["capture", "eager", "aot_eager"])),
        "module_hook": draw(st.sampled_from([None, "before", "after"])),
        "rows": draw(st.lists(st.integers(1, 4), min_size=2, max_size=4)),
    }


def check_world(spec: dict) -> None:
    stampout.reset()
    ref, test = build_world(spec["effects"], spec["layers"]), build_world(spec["effects"], spec["layers"])
    note(test.src)
    if spec["module_hook"] == "before":
        _hook(ref)
        _hook(test)
    if spec["mode"] == "capture":
        # The capture is one eager call's Python: its draws are eager's first call's, and it puts the RNG
        # states back; the memo contents and stored values are as that eager call leaves them.
        rows = spec["rows"][0]  # (a capture has the sizes it saw)
        seeded = _seed(1)
        try:
            cap = stampout.capture(test.model, _input(rows))
        except stampout.StampoutError:
            allowed = spec["module_hook"] == "before" or "saved_hooks" in spec["effects"]
            assert allowed, "capture refused a program it should capture"
            return
        assert _rng() == seeded, "the capture did not put the RNG states back"
        assert not fakes_in([world_state(test), test.model]), "the capture left fakes in user state"
        expected = _call(ref.model, ref, rows, 1)
        actual = _call(cap, test, rows, None)
        tree_assert_close(actual[:3], expected[:3], **TOL)
        # (the capture computes the values it leaves in memos and globals without autograd)
        tree_assert_close(actual[3], expected[3], "world", check_requires_grad=False, **TOL)
        return
    fn = stampout.compile(test.model, backend=spec["mode"])
    for i, rows in enumerate(spec["rows"]):
        if spec["module_hook"] == "after" and i == 1:
            _hook(ref)
            _hook(test)
        expected = (*_call(ref.model, ref, rows, i), _rng())
        actual = (*_call(fn, test, rows, i), _rng())
        assert not fakes_in([world_state(test), test.model]), f"call {i} left fakes in user state"
        tree_assert_close(actual, expected, f"call {i} (rows={rows})", **TOL)


@settings(max_examples=examples(60), deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(spec=worlds())
def test_world_effects_equal_eager(spec: dict) -> None:
    check_world(spec)
