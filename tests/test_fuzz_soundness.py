"""Differential fuzzing of stampout's reuse and compile guards against eager PyTorch.

Each example builds two identical worlds from one spec: a stack of 2-5 layers whose `forward` is a
`stampout.region` and reads Python state of several *kinds* (instance and class attributes, configs in
dicts / lists / namespaces / dataclasses / namedtuples, partials, closures, bound methods, hooks, per-instance
forwards, tied weights, globals, tensors held in containers, buffers, properties, `__getattr__` bags, ...).
Each world is generated source (`exec`), so it has its own module globals, closures and classes. Every
change of state is applied to both worlds; the reference world runs eagerly, the other through
`stampout.capture` (state set per layer at construction and between region calls inside the program) or
`stampout.compile(backend="eager")` (state changed between calls). Outputs, gradients and buffers must
match; a `StampoutError` is accepted only from kinds that make Python side effects.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import linecache
import math
import os
import random
import textwrap
import types
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fuzzing import examples
from helpers import scalar_loss, tree_assert_close
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from torch import nn
from torch.nn.utils import parametrize

import stampout

D = 4
SCALES = (0.5, 2.0, -1.0)
TOL = {"rtol": 1e-4, "atol": 1e-5}
ENV_FLAG = "STAMPOUT_FUZZ_FLAG"

# ------------------------------------------------------------------------------- values the worlds use


class Mode(enum.Enum):
    A = 0
    B = 1
    C = 2


FuzzNT = namedtuple("FuzzNT", ["s", "n"])


@dataclass
class FuzzDC:
    s: float = 0.5
    on: bool = False


@dataclass(slots=True)
class FuzzSlots:
    s: float = 0.5


@dataclass(frozen=True)
class FuzzFrozen:
    s: float = 0.5


class AttrBag:
    """A config whose fields live in a dict and are served by `__getattr__`."""

    def __init__(self) -> None:
        self._d: dict[str, Any] = {"s": 0.5}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_d"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_scaler(s: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda h: h * s


def tab(v: int) -> torch.Tensor:
    return torch.full((D,), SCALES[v], dtype=torch.float32)


def _post_tanh(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 2.0


def _post_neg(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return -h + 0.25


def _post_sq(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * h.abs()


POSTS = (_post_tanh, _post_neg, _post_sq)


def _helper_half(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * 0.5


def _helper_tanh(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) + 0.1


def _helper_neg(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return -h


HELPERS = (_helper_half, _helper_tanh, _helper_neg)


def _inner_half(h: torch.Tensor) -> torch.Tensor:
    return h * 0.5


def _inner_sin(h: torch.Tensor) -> torch.Tensor:
    return torch.sin(h) * 3.0


def _inner_neg(h: torch.Tensor) -> torch.Tensor:
    return -h


INNERS = (_inner_half, _inner_sin, _inner_neg)
STATICS = (torch.tanh, torch.sin, torch.neg)
PERMS = ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2])


def _alt_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight) * -1.5


def fixed_linear(seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(100 + seed)
    lin = nn.Linear(D, D, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=g))
        lin.bias.copy_(torch.randn(D, generator=g))
    return lin


_GLOBAL_HOOK: dict[str, Any] = {}


def _global_linear_hook(module: nn.Module, args: Any, out: Any) -> Any:
    if isinstance(module, nn.Linear) and module.in_features == D and module.out_features == D:
        return out * 1.5
    return None


# ---------------------------------------------------------------------------------------- world kinds


@dataclass
class World:
    """One generated world: its module namespace `g`, the factory's locals `f` (closures, classes) and the
    model; `saved` keeps objects perturbations restore (untied weights), keyed by `key(obj)`."""

    g: dict[str, Any]
    f: dict[str, Any]
    model: nn.Module
    kinds: list[Kind]
    init_values: list[dict[str, int]]
    saved: dict[Any, Any] = field(default_factory=dict)
    held: list[Any] = field(default_factory=list)

    def key(self, obj: Any) -> int:
        """`id(obj)`, with `obj` held for the world's life: a dropped layer's id must not come back as a new
        layer's key (CPython reuses addresses), or the two worlds' models would differ by chance."""
        self.held.append(obj)
        return id(obj)

    @property
    def cls(self) -> type:
        return self.f["FuzzLayer"]


Setter = Callable[[World, nn.Module, int], None]


@dataclass(frozen=True)
class Kind:
    """A kind of Python state a layer's forward reads: where it lives (class body, `__init__`, module
    globals, factory closure), the forward code reading it, and how to set it to value index `v`."""

    name: str
    n: int
    code: str = ""
    init: str = ""
    class_body: str = ""
    module_src: str = ""
    closure_src: str = ""
    set: Setter = lambda w, layer, v: None
    shared: bool = False  # one value for all layers (globals, closures, class attributes)
    side_effect: bool = False
    in_program: bool = True  # may be changed between region calls inside a captured program


def pooled(w: World, layer: nn.Module | None, key: str, v: int, make: Callable[[], Any]) -> Any:
    """The world's object for (`key`, layer, `v`), made once. Schedules are run once before a capture, so
    objects holding tensors are made outside it: in-program changes rebind existing objects."""
    k = ("pool", key, w.key(layer), v)
    if k not in w.saved:
        w.saved[k] = make()
    return w.saved[k]


def _tab(w: World, layer: nn.Module | None, key: str, v: int) -> torch.Tensor:
    return pooled(w, layer, key, v, lambda: tab(v))


def _attr(name: str, values: tuple) -> Setter:
    return lambda w, layer, v: setattr(layer, name, values[v])


def _set_hook(w: World, layer: nn.Module, v: int, target: str) -> None:
    mod = layer if target == "" else getattr(layer, target)
    key = ("hook", w.key(mod))
    handle = w.saved.pop(key, None)
    if handle is not None:
        handle.remove()
    if v == 1:
        w.saved[key] = mod.register_forward_hook(lambda m, args, out: out * 2.0 + 0.5)
    elif v == 2:
        w.saved[key] = mod.register_forward_pre_hook(lambda m, args: (args[0] * -1.0, *args[1:]))


def _set_sub_forward(w: World, layer: nn.Module, v: int) -> None:
    sub = layer.sub_f
    sub.__dict__.pop("forward", None)
    if v == 1:
        sub.forward = lambda x: F.linear(x, sub.weight, sub.bias) * 2.0
    elif v == 2:
        sub.forward = types.MethodType(_alt_linear_forward, sub)


def _set_layer_forward(w: World, layer: nn.Module, v: int) -> None:
    layer.__dict__.pop("forward", None)
    if v == 1:  # same region function, rebound per instance: reuse is fine, results must still be right
        layer.forward = types.MethodType(w.cls.forward, layer)
    elif v == 2:
        layer.forward = types.MethodType(w.g["_alt_layer_forward"], layer)


def _set_tied(w: World, layer: nn.Module, v: int) -> None:
    own = w.saved.setdefault(("tb", w.key(layer)), layer.tb.weight)
    layer.tb.weight = layer.ta.weight if v == 1 else own


def _set_param_data(w: World, layer: nn.Module, v: int) -> None:
    layer.ps.data = pooled(w, layer, "ps", v, lambda: torch.full(((D,), (1,), (D,))[v], SCALES[v]))


def _set_env(w: World, layer: nn.Module, v: int) -> None:
    os.environ[ENV_FLAG] = str(v)


def _set_global_hook(w: World, layer: nn.Module, v: int) -> None:
    handle = _GLOBAL_HOOK.pop("h", None)
    if handle is not None:
        handle.remove()
    if v == 1:
        _GLOBAL_HOOK["h"] = nn.modules.module.register_module_forward_hook(_global_linear_hook)


def _set_class(w: World, layer: nn.Module, v: int) -> None:
    layer.__class__ = (w.cls, w.f["FuzzAlt"])[v]


def _set_mode_train(w: World, layer: nn.Module, v: int) -> None:
    layer.train(v == 0)


class Scale2(nn.Module):
    """A parametrization: the weight used is twice the stored one."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2.0


class Transposed(nn.Module):
    """A parametrization: the weight used is the stored one, transposed."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.t()


def _set_parametrization(w: World, layer: nn.Module, v: int) -> None:
    sub = layer.sub_p
    if parametrize.is_parametrized(sub, "weight"):
        parametrize.remove_parametrizations(sub, "weight", leave_parametrized=False)
    if v:
        parametrize.register_parametrization(sub, "weight", (Scale2, Transposed)[v - 1]())


class MappingCfg:
    """A user config class with `__getitem__` over a private dict."""

    def __init__(self) -> None:
        self._items = {"s": 0.5}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]


def _set_inner(w: World, layer: nn.Module, v: int) -> None:
    inner = layer.inner
    while len(inner) > 1:
        del inner[len(inner) - 1]
    for i in range(v):
        inner.append(pooled(w, layer, "inner", i, (nn.Sigmoid, functools.partial(fixed_linear, 1))[i]))


def _set_default_dtype(w: World, layer: nn.Module, v: int) -> None:
    torch.set_default_dtype((torch.float32, torch.float64)[v])


KINDS: tuple[Kind, ...] = (
    Kind("inst_float", 3, code="h = h * self.k_inst", set=_attr("k_inst", SCALES)),
    Kind("inst_int_roll", 3, code="h = torch.roll(h, self.k_roll, dims=-1)", set=_attr("k_roll", (0, 1, 3))),
    Kind("inst_flag", 2, code="if self.k_flag:\n    h = torch.relu(h) - 0.5", set=_attr("k_flag", (False, True))),
    Kind("num_type", 3, code="if type(self.k_num) is int:\n    h = h + 1.0\nelif type(self.k_num) is bool:\n"
         "    h = h - 1.0\nh = h * self.k_num", set=_attr("k_num", (1, 1.0, True))),
    Kind("str_cfg", 3, code='if self.k_str == "tanh":\n    h = torch.tanh(h)\nelif self.k_str == "neg":\n'
         "    h = -h\nelse:\n    h = h * 2.0", set=_attr("k_str", ("tanh", "neg", "dbl"))),
    Kind("enum_cfg", 3, code="if self.mode is Mode.A:\n    h = torch.tanh(h)\nelif self.mode == Mode.B:\n"
         "    h = h * 2.0\nelse:\n    h = -h", set=_attr("mode", tuple(Mode))),
    Kind("dunder_dict_write", 3, code="h = h * self.k_raw",
         set=lambda w, layer, v: layer.__dict__.__setitem__("k_raw", SCALES[v])),
    Kind("object_setattr", 3, code="h = h + self.k_obj",
         set=lambda w, layer, v: object.__setattr__(layer, "k_obj", SCALES[v])),
    Kind("dunder_dict_read", 3, code='h = h * self.__dict__.get("k_dd", 1.0)', set=_attr("k_dd", SCALES)),
    Kind("vars_read", 3, code='h = h * vars(self)["k_vars"]', set=_attr("k_vars", SCALES)),
    Kind("hasattr_optional", 2, code='if hasattr(self, "k_opt"):\n    h = h * self.k_opt',
         set=lambda w, layer, v: layer.__dict__.pop("k_opt", None) if v == 0 else setattr(layer, "k_opt", -3.0)),
    Kind("getattr_default", 2, code='h = h * getattr(self, "k_gd", 0.25)',
         set=lambda w, layer, v: layer.__dict__.pop("k_gd", None) if v == 0 else setattr(layer, "k_gd", 4.0)),
    Kind("class_override", 3, class_body="k_cls = 0.5", code="h = h * self.k_cls",
         set=lambda w, layer, v: layer.__dict__.pop("k_cls", None) if v == 0 else setattr(layer, "k_cls", SCALES[v])),
    Kind("class_shared", 3, class_body="k_cls2 = 0.5", code="h = h * self.k_cls2", shared=True,
         set=lambda w, layer, v: setattr(w.cls, "k_cls2", SCALES[v])),
    Kind("classmethod", 3, class_body="k_cm = 0.5\n@classmethod\ndef scale_for(cls):\n    return cls.k_cm",
         code="h = h * self.scale_for()", shared=True, set=lambda w, layer, v: setattr(w.cls, "k_cm", SCALES[v])),
    Kind("class_method_swap", 3, class_body="def helper(self, h):\n    return h * 0.5", code="h = self.helper(h)",
         shared=True, set=lambda w, layer, v: setattr(w.cls, "helper", HELPERS[v])),
    Kind("mixin_super", 3, class_body="def mix(self, h):\n    return super().mix(h) + 1.0", code="h = self.mix(h)",
         set=_attr("k_mix", SCALES)),
    Kind("mixin_swap", 3, code="h = self.mix2(h)", shared=True,
         set=lambda w, layer, v: setattr(w.f["FuzzMixin"], "mix2", HELPERS[v])),
    Kind("property", 3, class_body="@property\ndef k_prop(self):\n    return self._k_prop_raw * 2.0",
         code="h = h * self.k_prop", set=_attr("_k_prop_raw", SCALES)),
    Kind("getattr_bag", 3, init="self.bag = AttrBag()", code="h = h * self.bag.s",
         set=lambda w, layer, v: layer.bag._d.__setitem__("s", SCALES[v])),
    Kind("getattr_torch_name", 3, code="h = getattr(torch, self.act_name)(h)",
         set=_attr("act_name", ("tanh", "sigmoid", "sin"))),
    Kind("getattr_self_name", 3, init="self.w_a = nn.Parameter(torch.full((D,), 0.5))\n"
         "self.w_b = nn.Parameter(torch.full((D,), 2.0))\nself.w_c = nn.Parameter(torch.full((D,), -1.0))",
         code="h = h * getattr(self, self.which)", set=_attr("which", ("w_a", "w_b", "w_c"))),
    Kind("dict_cfg", 3, init='self.cfg_d = {"s": 0.5}', code='h = h * self.cfg_d["s"]',
         set=lambda w, layer, v: layer.cfg_d.__setitem__("s", SCALES[v])),
    Kind("dict_shared", 3, closure_src='shared_d = {"s": 0.5}', init="self.cfg_sd = shared_d",
         code='h = h * self.cfg_sd["s"]', shared=True,
         set=lambda w, layer, v: w.f["shared_d"].__setitem__("s", SCALES[v])),
    Kind("list_cfg", 3, init="self.cfg_l = [0.5, 0]", code="h = h * self.cfg_l[0]",
         set=lambda w, layer, v: layer.cfg_l.__setitem__(0, SCALES[v])),
    Kind("namespace_cfg", 3, init="self.cfg_ns = types.SimpleNamespace(s=0.5)", code="h = h * self.cfg_ns.s",
         set=lambda w, layer, v: setattr(layer.cfg_ns, "s", SCALES[v])),
    Kind("dataclass_cfg", 3, init="self.cfg_dc = FuzzDC()", code="h = h * self.cfg_dc.s",
         set=lambda w, layer, v: setattr(layer.cfg_dc, "s", SCALES[v])),
    Kind("slots_cfg", 3, init="self.cfg_sl = FuzzSlots()", code="h = h * self.cfg_sl.s",
         set=lambda w, layer, v: setattr(layer.cfg_sl, "s", SCALES[v])),
    Kind("frozen_replace", 3, init="self.cfg_fz = FuzzFrozen()", code="h = h * self.cfg_fz.s",
         set=lambda w, layer, v: setattr(layer, "cfg_fz", dataclasses.replace(layer.cfg_fz, s=SCALES[v]))),
    Kind("namedtuple_cfg", 3, init="self.cfg_nt = FuzzNT(0.5, 0)", code="h = h * self.cfg_nt.s",
         set=lambda w, layer, v: setattr(layer, "cfg_nt", layer.cfg_nt._replace(s=SCALES[v]))),
    Kind("partial", 3, init="self.act = functools.partial(F.leaky_relu, negative_slope=0.01)", code="h = self.act(h)",
         set=lambda w, layer, v: setattr(layer, "act", functools.partial(F.leaky_relu, negative_slope=SCALES[v]))),
    Kind("partial_kw_mutate", 3, init="self.act2 = functools.partial(F.leaky_relu, negative_slope=0.01)",
         code="h = self.act2(h)", set=lambda w, layer, v: layer.act2.keywords.__setitem__("negative_slope", SCALES[v])),
    Kind("lambda_cell", 3, init="self.fn = make_scaler(0.5)", code="h = self.fn(h)",
         set=lambda w, layer, v: setattr(layer.fn.__closure__[0], "cell_contents", SCALES[v])),
    Kind("lambda_new", 3, code="h = self.fn2(h)",
         set=lambda w, layer, v: setattr(layer, "fn2", make_scaler(SCALES[v]))),
    Kind("bound_method", 3, code="h = self.post(h)",
         set=lambda w, layer, v: setattr(layer, "post", types.MethodType(POSTS[v], layer))),
    Kind("inst_function", 3, code="h = self.st(h)", set=_attr("st", STATICS)),
    Kind("sub_hook", 3, init="self.sub_h = nn.Linear(D, D)", code="h = h + self.sub_h(h)",
         set=lambda w, layer, v: _set_hook(w, layer, v, "sub_h")),
    Kind("layer_hook", 3, set=lambda w, layer, v: _set_hook(w, layer, v, "")),
    Kind("sub_forward", 3, init="self.sub_f = nn.Linear(D, D)", code="h = h + self.sub_f(h)", set=_set_sub_forward),
    Kind("layer_forward", 3, module_src="@stampout.region\ndef _alt_layer_forward(self, x):\n"
         "    return torch.sin(self.fc(x)) * 3.0", set=_set_layer_forward),
    Kind("tied", 2, init="self.ta = nn.Linear(D, D, bias=False)\nself.tb = nn.Linear(D, D, bias=False)",
         code="h = self.tb(torch.tanh(self.ta(h)))", set=_set_tied),
    Kind("global_chain", 3, module_src="G_SCALE = 0.5\ndef _g_inner(h):\n    return h * G_SCALE\n"
         "def _g_outer(h):\n    return _g_inner(h) + 1.0", code="h = _g_outer(h)", shared=True,
         set=lambda w, layer, v: w.g.__setitem__("G_SCALE", SCALES[v])),
    Kind("global_fn_rebind", 3, module_src="_r_inner = _inner_half\ndef _r_outer(h):\n    return _r_inner(h) - 1.0",
         code="h = _r_outer(h)", shared=True, set=lambda w, layer, v: w.g.__setitem__("_r_inner", INNERS[v])),
    Kind("global_dict", 3, module_src='G_CFG = {"s": 0.5}', code='h = h * G_CFG["s"]', shared=True,
         set=lambda w, layer, v: w.g["G_CFG"].__setitem__("s", SCALES[v])),
    Kind("global_tensor", 3, module_src="G_TAB = tab(0)", code="h = h * G_TAB", shared=True,
         set=lambda w, layer, v: w.g.__setitem__("G_TAB", _tab(w, None, "G_TAB", v))),
    Kind("module_object_attr", 3, module_src='cfgmod = types.ModuleType("cfgmod")\ncfgmod.S = 0.5',
         code="h = h * cfgmod.S", shared=True, set=lambda w, layer, v: setattr(w.g["cfgmod"], "S", SCALES[v])),
    Kind("fn_defaults", 3, module_src="def _dflt(h, s=0.5):\n    return h * s", code="h = _dflt(h)", shared=True,
         set=lambda w, layer, v: setattr(w.g["_dflt"], "__defaults__", (SCALES[v],))),
    Kind("fn_kwdefaults", 3, module_src="def _kwd(h, *, s=0.5):\n    return h * s", code="h = _kwd(h)", shared=True,
         set=lambda w, layer, v: setattr(w.g["_kwd"], "__kwdefaults__", {"s": SCALES[v]})),
    Kind("closure_nonlocal", 3, closure_src="c_scale = 0.5\ndef set_c_scale(v):\n    nonlocal c_scale\n"
         "    c_scale = v", code="h = h * c_scale", shared=True,
         set=lambda w, layer, v: w.f["set_c_scale"](SCALES[v])),
    Kind("closure_obj", 3, closure_src="c_cfg = types.SimpleNamespace(s=0.5)", code="h = h * c_cfg.s", shared=True,
         set=lambda w, layer, v: setattr(w.f["c_cfg"], "s", SCALES[v])),
    Kind("closure_tensor_list", 3, closure_src="c_tabs = [tab(0)]", code="h = h * c_tabs[0]", shared=True,
         set=lambda w, layer, v: w.f["c_tabs"].__setitem__(0, _tab(w, None, "c_tabs", v))),
    Kind("tensor_list_attr", 3, init="self.tabs = [tab(0)]", code="h = h * self.tabs[0]",
         set=lambda w, layer, v: layer.tabs.__setitem__(0, _tab(w, layer, "tabs", v))),
    Kind("tensor_dict_attr", 3, init='self.tdict = {"t": tab(0)}', code='h = h * self.tdict["t"]',
         set=lambda w, layer, v: layer.tdict.__setitem__("t", _tab(w, layer, "tdict", v))),
    Kind("tensor_plain_attr", 3, init="self.tplain = tab(0)", code="h = h * self.tplain",
         set=lambda w, layer, v: setattr(layer, "tplain", _tab(w, layer, "tplain", v))),
    Kind("buffer_setattr", 3, init='self.register_buffer("buf", tab(0))', code="h = h * self.buf",
         set=lambda w, layer, v: setattr(layer, "buf", _tab(w, layer, "buf", v))),
    Kind("buffer_dict_swap", 3, init='self.register_buffer("buf2", tab(0))', code="h = h * self.buf2",
         set=lambda w, layer, v: layer._buffers.__setitem__("buf2", _tab(w, layer, "buf2", v))),
    Kind("buffer_inplace", 3, init='self.register_buffer("buf3", tab(0))', code="h = h * self.buf3",
         set=lambda w, layer, v: layer.buf3.copy_(_tab(w, layer, "buf3", v))),
    Kind("param_dict_swap", 3, init="self.pw = nn.Parameter(tab(0))", code="h = h * self.pw",
         set=lambda w, layer, v: layer._parameters.__setitem__(
             "pw", pooled(w, layer, "pw", v, lambda: nn.Parameter(tab(v))))),
    Kind("param_data_shape", 3, init="self.ps = nn.Parameter(torch.ones(D))", code="h = h * self.ps",
         set=_set_param_data, in_program=False),
    Kind("requires_grad", 2, set=lambda w, layer, v: layer.fc.weight.requires_grad_(v == 0)),
    Kind("train_eval", 2, init="self.drop = nn.Dropout(0.0)", code="if self.training:\n    h = h * 3.0\n"
         "h = self.drop(h)", set=_set_mode_train),
    Kind("batchnorm", 2, init="self.bn = nn.BatchNorm1d(D)", code="h = self.bn(h)",
         set=lambda w, layer, v: layer.bn.train(v == 1)),
    Kind("parameter_list", 3, init="self.plist = nn.ParameterList([nn.Parameter(tab(i)) for i in range(3)])",
         code="h = h * self.plist[self.p_idx]", set=_attr("p_idx", (0, 1, 2))),
    Kind("module_dict", 3, init='self.mdict = nn.ModuleDict({"a": nn.Tanh(), "b": nn.Linear(D, D), '
         '"c": nn.Identity()})', code="h = self.mdict[self.m_key](h)", set=_attr("m_key", ("a", "b", "c"))),
    Kind("module_swap", 3, init="self.swap = nn.Identity()", code="h = self.swap(h)",
         set=lambda w, layer, v: setattr(layer, "swap", pooled(
             w, layer, "swap", v, lambda: (nn.Identity, nn.Tanh, functools.partial(fixed_linear, 0))[v]()))),
    Kind("type_is_check", 2, init="self.sub_t = nn.Tanh()", code="if type(self.sub_t) is nn.Tanh:\n"
         "    h = self.sub_t(h)\nelse:\n    h = h * 0.5",
         set=lambda w, layer, v: setattr(layer, "sub_t", pooled(w, layer, "sub_t", v, (nn.Tanh, nn.Sigmoid)[v]))),
    Kind("class_swap", 2, code="h = self.extra(h)", set=_set_class),
    Kind("dtype_switch", 2, init="self.dt = nn.Linear(D, D)",
         code="h = self.dt(h.to(self.dt.weight.dtype)).to(x.dtype)",
         set=lambda w, layer, v: layer.dt.to((torch.float32, torch.float64)[v]), in_program=False),
    Kind("inplace_list_perm", 3, init="self.perm = [0, 1, 2, 3]", code="h = h[:, self.perm]",
         set=lambda w, layer, v: layer.perm.__setitem__(slice(None), PERMS[v])),
    Kind("env_flag", 2, code=f'if os.environ.get("{ENV_FLAG}") == "1":\n    h = h * 2.0', shared=True, set=_set_env),
    Kind("global_module_hook", 2, shared=True, set=_set_global_hook),
    Kind("grad_mode_branch", 1, code="if torch.is_grad_enabled():\n    h = h * 2.0"),
    Kind("parametrization", 3, init="self.sub_p = nn.Linear(D, D)", code="h = h + self.sub_p(h)",
         set=_set_parametrization, in_program=False),
    Kind("mapping_cfg", 3, init="self.cfg_map = MappingCfg()", code='h = h * self.cfg_map["s"]',
         set=lambda w, layer, v: layer.cfg_map._items.__setitem__("s", SCALES[v])),
    Kind("tensor_pyattr", 3, init="self.fc.weight.k_tattr = 0.5", code="h = h * self.fc.weight.k_tattr",
         set=lambda w, layer, v: setattr(layer.fc.weight, "k_tattr", SCALES[v])),
    Kind("inner_modulelist", 3, init="self.inner = nn.ModuleList([nn.Tanh()])",
         code="for block in self.inner:\n    h = block(h) * 1.5", set=_set_inner),
    Kind("default_dtype", 2, code="if torch.zeros(1).dtype == torch.float64:\n    h = h * 2.0", shared=True,
         set=_set_default_dtype),
    Kind("py_random", 3, module_src="RNG = random.Random(0)", code="if RNG.random() < 0.5:\n    h = h * -2.0",
         shared=True, side_effect=True, set=lambda w, layer, v: w.g["RNG"].seed(v)),
    Kind("counter_branch", 1, init="self.n_calls = 0", code="self.n_calls += 1\nif self.n_calls % 2 == 0:\n"
         "    h = h * 2.0", side_effect=True),
    Kind("side_counter", 1, init="self.calls = 0", code="self.calls += 1", side_effect=True),
    Kind("side_global_append", 1, module_src="G_LOG = []", code="G_LOG.append(1)", side_effect=True),
)
KIND_BY_NAME = {k.name: k for k in KINDS}
SIDE_EFFECT_KINDS = {k.name for k in KINDS if k.side_effect}

# ------------------------------------------------------------------------------------- building worlds

_WORLD_COUNT = [0]


def _indent(text: str, n: int) -> str:
    return textwrap.indent(textwrap.dedent(text), " " * n) if text else ""


def world_source(kinds: list[Kind]) -> str:
    """The source of one world: module helpers, then a factory whose locals are closures and classes."""
    module = "\n".join(k.module_src for k in kinds if k.module_src)
    closure = "\n".join(k.closure_src for k in kinds if k.closure_src)
    class_body = "\n".join(k.class_body for k in kinds if k.class_body)
    init = "\n".join(k.init for k in kinds if k.init)
    code = "\n".join(k.code for k in kinds if k.code)
    return (
        f"{module}\n\n"
        "def _factory():\n"
        f"{_indent(closure, 4)}\n"
        "    class FuzzMixin:\n"
        "        def mix(self, h):\n"
        "            return h * self.k_mix\n\n"
        "        def mix2(self, h):\n"
        "            return h * 0.5\n\n"
        "    class FuzzLayer(FuzzMixin, nn.Module):\n"
        f"{_indent(class_body, 8)}\n"
        "        def __init__(self):\n"
        "            super().__init__()\n"
        "            self.fc = nn.Linear(D, D)\n"
        f"{_indent(init, 12)}\n"
        "        def extra(self, h):\n"
        "            return h\n\n"
        "        @stampout.region\n"
        "        def forward(self, x):\n"
        "            h = self.fc(x)\n"
        f"{_indent(code, 12)}\n"
        "            return x + torch.tanh(h)\n\n"
        "    class FuzzAlt(FuzzLayer):\n"
        "        def extra(self, h):\n"
        "            return h * -2.0 + 0.5\n\n"
        "    return locals()\n"
    )


class FuzzStack(nn.Module):
    """The program: layers called in order; `schedule[i]` (callables) runs just before layer i."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.schedule: list[list[Callable[[], None]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.schedule:
                for op in self.schedule[i]:
                    op()
            x = layer(x)
        return x


def build_world(kinds: list[Kind], n_layers: int, init_values: list[dict[str, int]]) -> tuple[World, str]:
    """A fresh world: exec its source into a new namespace, build `n_layers` layers, set each layer's state."""
    src = world_source(kinds)
    _WORLD_COUNT[0] += 1
    filename = f"<stampout-fuzz-world-{_WORLD_COUNT[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    g: dict[str, Any] = {
        "__name__": f"fuzz_world_{_WORLD_COUNT[0]}", "torch": torch, "nn": nn, "F": F, "stampout": stampout,
        "functools": functools, "types": types, "os": os, "math": math, "D": D, "Mode": Mode, "FuzzNT": FuzzNT,
        "FuzzDC": FuzzDC, "FuzzSlots": FuzzSlots, "FuzzFrozen": FuzzFrozen, "AttrBag": AttrBag,
        "make_scaler": make_scaler, "tab": tab, "_inner_half": _inner_half, "MappingCfg": MappingCfg,
        "random": random,
    }
    exec(compile(src, filename, "exec"), g)  # noqa: S102 - the world is generated source on purpose
    f = g["_factory"]()
    torch.set_default_dtype(torch.float32)  # a previous world may have changed it (default_dtype kind)
    torch.manual_seed(0)
    layers = [f["FuzzLayer"]() for _ in range(n_layers)]
    world = World(g, f, FuzzStack(layers), kinds, init_values)
    for layer, values in zip(layers, init_values):
        init_layer(world, layer, values)
    for kind in kinds:
        if kind.shared:
            kind.set(world, layers[0], init_values[0][kind.name])
    return world, src


def init_layer(world: World, layer: nn.Module, values: dict[str, int]) -> None:
    """Set a freshly built layer's own state (kinds that are not shared) to `values`."""
    for kind in world.kinds:
        if not kind.shared:
            kind.set(world, layer, values[kind.name])


def _cleanup_process_state() -> None:
    torch.set_default_dtype(torch.float32)
    os.environ.pop(ENV_FLAG, None)
    handle = _GLOBAL_HOOK.pop("h", None)
    if handle is not None:
        handle.remove()


# ------------------------------------------------------------------------------------------ comparing


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(model: Callable[..., Any], params_of: nn.Module, x: torch.Tensor, grad: bool) -> tuple[Any, dict]:
    for p in params_of.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = model(x)
    grads: dict[str, Any] = {}
    if grad and isinstance(out, torch.Tensor) and out.requires_grad:
        scalar_loss(out).backward()
        grads = _grads(params_of)
        grads["<input>"] = None if x.grad is None else x.grad.clone()
    return out, grads


def _compare(actual: tuple[Any, dict], expected: tuple[Any, dict], ref: World, test: World, what: str) -> None:
    out_a, g_a = actual
    out_e, g_e = expected
    tree_assert_close(out_a, out_e, f"{what}: out", **TOL)
    assert list(g_a) == list(g_e), f"{what}: gradient names {list(g_a)} != {list(g_e)}"
    for name, e in g_e.items():
        a = g_a[name]
        assert (a is None) == (e is None), f"{what}: grad of {name}: eager {e is not None}, stampout {a is not None}"
        if e is not None:
            torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{what}: grad of {n}: {m}", **TOL)
    bufs_e, bufs_a = dict(ref.model.named_buffers()), dict(test.model.named_buffers())
    assert list(bufs_a) == list(bufs_e), f"{what}: buffers {list(bufs_a)} != {list(bufs_e)}"
    for name, e in bufs_e.items():
        torch.testing.assert_close(bufs_a[name], e, msg=lambda m, n=name: f"{what}: buffer {n}: {m}", **TOL)
    for counter in ("calls", "n_calls"):
        calls_e = [layer.__dict__.get(counter) for layer in ref.model.layers]
        calls_a = [layer.__dict__.get(counter) for layer in test.model.layers]
        assert calls_a == calls_e, f"{what}: self.{counter} {calls_a} != eager {calls_e}"
    if "RNG" in ref.g:
        assert test.g["RNG"].getstate() == ref.g["RNG"].getstate(), f"{what}: RNG state differs from eager's"
    if "G_LOG" in ref.g:
        assert len(test.g["G_LOG"]) == len(ref.g["G_LOG"]), (
            f"{what}: G_LOG has {len(test.g['G_LOG'])} entries, eager {len(ref.g['G_LOG'])}")


# ----------------------------------------------------------------------------------------- strategies


@st.composite
def world_specs(draw: st.DrawFn, forced: str | None = None) -> dict[str, Any]:
    """Kinds (`forced` alone, or 1-3 random ones), 2-5 layers and each layer's construction-time value per
    kind."""
    names = [k.name for k in KINDS]
    kinds = [forced] if forced else draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    n_layers = draw(st.integers(2, 5))
    values = [{name: draw(st.integers(0, KIND_BY_NAME[name].n - 1)) for name in kinds} for _ in range(n_layers)]
    return {"kinds": kinds, "n_layers": n_layers, "values": values}


@st.composite
def capture_cases(draw: st.DrawFn, forced: str | None = None) -> dict[str, Any]:
    """A world plus in-program changes: before layer i, set some kinds (of layer i, or shared) to a value."""
    spec = draw(world_specs(forced))
    schedule = []
    for _ in range(spec["n_layers"]):
        ops = []
        for name in spec["kinds"]:
            kind = KIND_BY_NAME[name]
            if kind.n > 1 and kind.in_program and draw(st.booleans()):
                ops.append((name, draw(st.integers(0, kind.n - 1))))
        schedule.append(ops)
    spec["schedule"] = schedule if draw(st.booleans()) else []
    return spec


STACK_OPS = ("swap_layers", "drop_last_layer", "append_layer_copy")


@st.composite
def compile_cases(draw: st.DrawFn, forced: str | None = None) -> dict[str, Any]:
    """A world plus 1-3 rounds of changes between compiled calls; each call with or without grad, on a
    row-major or a column-major input."""
    spec = draw(world_specs(forced))
    rounds = []
    for _ in range(draw(st.integers(1, 3))):
        changes = []
        for _ in range(draw(st.integers(1, 3))):
            what = draw(st.sampled_from([*spec["kinds"], *spec["kinds"], "stack"]))
            if what == "stack":
                changes.append(("stack", draw(st.sampled_from(STACK_OPS)), 0))
            else:
                kind = KIND_BY_NAME[what]
                changes.append((what, draw(st.integers(0, 9)), draw(st.integers(0, kind.n - 1))))
        rounds.append({"changes": changes, "grad": draw(st.booleans()), "transposed_input": draw(st.booleans())})
    spec["rounds"] = rounds
    spec["first_grad"] = draw(st.booleans())
    return spec


# ---------------------------------------------------------------------------------------- the checks


def _note(text: str) -> None:
    """`hypothesis.note` inside a test; print otherwise (the checks also run from plain scripts)."""
    try:
        note(text)
    except InvalidArgument:
        print(text)


def _input() -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(7), dtype=torch.float32)


def check_capture_case(spec: dict[str, Any]) -> None:
    kinds = [KIND_BY_NAME[n] for n in spec["kinds"]]
    stampout.reset()
    try:
        ref, src = build_world(kinds, spec["n_layers"], spec["values"])
        test, _ = build_world(kinds, spec["n_layers"], spec["values"])
        _note(src)
        for world in (ref, test):
            if spec["schedule"]:
                world.model.schedule = [
                    [functools.partial(KIND_BY_NAME[name].set, world, world.model.layers[i], v) for name, v in ops]
                    for i, ops in enumerate(spec["schedule"])
                ]
                for ops in world.model.schedule:  # make the objects they bind outside the capture
                    for op in ops:
                        op()
        x = _input()
        expected = _run(ref.model, ref.model, x, grad=True)
        try:
            cap = stampout.capture(test.model, x.clone().requires_grad_(True))
        except stampout.StampoutError:
            if SIDE_EFFECT_KINDS & set(spec["kinds"]):
                return
            raise
        _note(f"stats: {cap.stats}")
        actual = _run(cap, test.model, x, grad=True)
        _compare(actual, expected, ref, test, "capture")
    finally:
        _cleanup_process_state()


def _apply_change(world: World, change: tuple[str, int, int]) -> None:
    what, a, v = change
    layers = world.model.layers
    if what == "stack":
        if a == "swap_layers" and len(layers) >= 2:
            layers[0], layers[1] = layers[1], layers[0]
        elif a == "drop_last_layer" and len(layers) >= 2:
            del layers[len(layers) - 1]
        elif a == "append_layer_copy":
            torch.manual_seed(len(layers))
            saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                new = world.cls()
                init_layer(world, new, world.init_values[0])
            finally:
                torch.set_default_dtype(saved_dtype)
            layers.append(new)
        return
    KIND_BY_NAME[what].set(world, layers[a % len(layers)], v)


def check_compile_case(spec: dict[str, Any]) -> None:
    kinds = [KIND_BY_NAME[n] for n in spec["kinds"]]
    side_effects = bool(SIDE_EFFECT_KINDS & set(spec["kinds"]))
    stampout.reset()
    try:
        ref, src = build_world(kinds, spec["n_layers"], spec["values"])
        test, _ = build_world(kinds, spec["n_layers"], spec["values"])
        _note(src)
        fn = stampout.compile(test.model, backend="eager")
        steps = [({"changes": [], "grad": spec["first_grad"]}), *spec["rounds"]]
        for i, step in enumerate(steps):
            for change in step["changes"]:
                _apply_change(ref, change)
                _apply_change(test, change)
            x = _input().t().contiguous().t() if step.get("transposed_input") else _input()
            what = f"call {i} after {step['changes']} (grad={step['grad']}, strides={x.stride()})"
            expected = _run(ref.model, ref.model, x, step["grad"])
            try:
                actual = _run(fn, test.model, x, step["grad"])
            except stampout.StampoutError:
                if side_effects and i == 0:
                    return
                raise
            _compare(actual, expected, ref, test, what)
    finally:
        _cleanup_process_state()


# -------------------------------------------------------------------------------------------- tests

NO_SHRINK = (Phase.explicit, Phase.generate)  # per-kind examples are small already; shrinking costs minutes
# Examples per kind (x 81 kinds, twice): each kind's space is its 2-3 values over 2-5 layers and 1-3 rounds; the mixed
# fuzzers below draw 40 each over all kinds together. STAMPOUT_FUZZ_SCALE=10 for a long run (was 12: 15 % of make test).
PER_KIND = 8


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
@settings(max_examples=examples(PER_KIND), deadline=None, derandomize=True, phases=NO_SHRINK)
@given(data=st.data())
def test_fuzz_capture_kind(kind: str, data: st.DataObject) -> None:
    """Capture: `kind` alone, set per layer at construction and between region calls."""
    check_capture_case(data.draw(capture_cases(kind)))


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
@settings(max_examples=examples(PER_KIND), deadline=None, derandomize=True, phases=NO_SHRINK)
@given(data=st.data())
def test_fuzz_compile_kind(kind: str, data: st.DataObject) -> None:
    """Compile (eager backend): `kind` alone, changed between calls."""
    check_compile_case(data.draw(compile_cases(kind)))


@settings(max_examples=examples(40), deadline=None, derandomize=True)
@given(spec=capture_cases())
def test_fuzz_capture_mixed(spec: dict[str, Any]) -> None:
    """Capture: 1-3 random kinds, random per-layer values, random in-program changes."""
    check_capture_case(spec)


@settings(max_examples=examples(40), deadline=None, derandomize=True)
@given(spec=compile_cases())
def test_fuzz_compile_mixed(spec: dict[str, Any]) -> None:
    """Compile: 1-3 random kinds, random changes (and layer-stack edits) between calls."""
    check_compile_case(spec)


# ----------------------------------------------- world effects: overlapping inputs, caller-passed containers

_VIEW_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "a.add_": lambda a, b: a.add_(1.0),
    "b.mul_": lambda a, b: b.mul_(2.0),
    "a.copy_(b)": lambda a, b: a.copy_(b * 0.5),
    "b.sub_(a.sum())": lambda a, b: b.sub_(a.sum()),
    "read": lambda a, b: None,
}


def _view_program(ops: list[str]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def program(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for op in ops:
            _VIEW_OPS[op](a, b)
        return a * 3.0 + b

    return program


@st.composite
def view_cases(draw: st.DrawFn) -> dict[str, Any]:
    """In-place ops on two views, called with views of one base (overlapping or not) and of two bases, with
    the same sizes and offsets: only where their memory overlaps tells the calls apart."""
    n = draw(st.integers(2, 5))
    ops = draw(st.lists(st.sampled_from(sorted(_VIEW_OPS)), min_size=1, max_size=4))
    calls = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans()), min_size=2, max_size=5))
    return {"n": n, "ops": ops, "calls": calls, "backend": draw(st.sampled_from(["eager", "aot_eager"]))}


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(spec=view_cases())
def test_fuzz_overlapping_inputs(spec: dict[str, Any]) -> None:
    """Compile: storage-overlapping inputs (`f(base[:5], base[1:])`) give eager's outputs and bases."""
    program = _view_program(spec["ops"])
    compiled = stampout.compile(program, backend=spec["backend"])
    n = spec["n"]
    for start_a, start_b, shared in spec["calls"]:
        bases = [torch.arange(12.0), torch.arange(12.0) + 100]
        refs = [t.clone() for t in bases]
        second, second_ref = (bases[0], refs[0]) if shared else (bases[1], refs[1])
        note(f"a = base[{start_a}:{start_a + n}], b = {'base' if shared else 'other'}[{start_b}:{start_b + n}]")
        got = compiled(bases[0][start_a:start_a + n], second[start_b:start_b + n])
        expected = program(refs[0][start_a:start_a + n], second_ref[start_b:start_b + n])
        torch.testing.assert_close(got, expected, **TOL)
        for t, r in zip(bases, refs):
            torch.testing.assert_close(t, r, **TOL)


_CONTAINER_OPS: dict[str, Callable[[torch.Tensor, dict, list], Any]] = {
    "d[k] = x": lambda x, d, items: d.__setitem__("k", x * 2.0),
    "d.setdefault": lambda x, d, items: d.setdefault("n", len(d)),
    "d.update": lambda x, d, items: d.update(v=x + 1.0, w=3),
    "del d[k]": lambda x, d, items: d.pop("k", None),
    "nested": lambda x, d, items: d.setdefault("layer", {}).setdefault("hist", []).append(x.sum()),
    "d[x] = input": lambda x, d, items: d.__setitem__("x", x),
    "append": lambda x, d, items: items.append(x.mean()),
    "insert": lambda x, d, items: items.insert(0, x * 3.0),
    "extend": lambda x, d, items: items.extend([1, 2]),
    "pop": lambda x, d, items: items.pop() if items else None,
}


def _container_program(ops: list[str]) -> Callable[[torch.Tensor, dict, list], torch.Tensor]:
    def program(x: torch.Tensor, d: dict, items: list) -> torch.Tensor:
        for op in ops:
            _CONTAINER_OPS[op](x, d, items)
        return x * len(d) + len(items)

    return program


def _same_world(a: Any, b: Any, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b, **TOL)
        assert (a is inputs[0]) == (b is inputs[1])  # the input itself where eager stored it
    elif isinstance(a, (dict, list)):
        assert type(a) is type(b) and len(a) == len(b)
        if isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                _same_world(a[k], b[k], inputs)
        else:
            for p, q in zip(a, b):
                _same_world(p, q, inputs)
    else:
        assert a == b


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(ops=st.lists(st.sampled_from(sorted(_CONTAINER_OPS)), min_size=1, max_size=5),
       keep=st.booleans(), backend=st.sampled_from(["eager", "aot_eager"]))
def test_fuzz_caller_containers(ops: list[str], keep: bool, backend: str) -> None:
    """Compile: a dict and a list the caller passes in and the program fills are filled by every compiled call
    as eager fills them (fresh containers per call, or the same ones across calls, read by the next call)."""
    program = _container_program(ops)
    compiled = stampout.compile(program, backend=backend)
    mine: tuple[dict, list] = ({"k": 0}, [torch.zeros(1)])
    theirs: tuple[dict, list] = ({"k": 0}, [torch.zeros(1)])
    for i in range(3):
        if not keep:
            mine, theirs = ({"k": 0}, [torch.zeros(1)]), ({"k": 0}, [torch.zeros(1)])
        x = torch.full((2,), float(i + 1))
        y = x.clone()
        try:
            got = compiled(x, *mine)
        except stampout.StampoutError:
            return  # (an explicit refusal is allowed; a silent difference is not)
        expected = program(y, *theirs)
        torch.testing.assert_close(got, expected, **TOL)
        _same_world(list(mine), list(theirs), (x, y))
