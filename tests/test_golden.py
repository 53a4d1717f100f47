"""Golden printouts: the graphs stampout builds for small cases, as FX prints them."""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return torch.relu(self.lin(x)) + x


OUTER = """
def forward(self, input, _0_lin_weight, _0_lin_bias, _1_lin_weight, _1_lin_bias):
    input_1 = input
    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', input_1, _0_lin_weight, _0_lin_bias);  subgraph_0 = input_1 = _0_lin_weight = _0_lin_bias = None
    getitem = invoke_subgraph[0];  invoke_subgraph = None
    subgraph_1 = self.subgraph_0
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', getitem, _1_lin_weight, _1_lin_bias);  subgraph_1 = getitem = _1_lin_weight = _1_lin_bias = None
    getitem_1 = invoke_subgraph_1[0];  invoke_subgraph_1 = None
    return (getitem_1,)
"""  # noqa: E501

REGION = """
def forward(self, x, self_lin_weight, self_lin_bias):
    linear = torch._C._nn.linear(x, self_lin_weight, self_lin_bias);  self_lin_weight = self_lin_bias = None
    relu = torch.relu(linear);  linear = None
    add = relu.add(x);  relu = x = None
    return (add,)
"""


def test_region_stack_graphs():
    cap = stampout.capture(nn.Sequential(Layer(), Layer()), torch.randn(2, 4))
    cap.gm.graph.lint()
    assert cap.gm.code.strip() == OUTER.strip()
    assert cap.gm.subgraph_0.code.strip() == REGION.strip()


def test_grad_mode_and_autocast_sections_stay_in_the_graph():
    def fn(x):
        with torch.no_grad():
            y = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = y @ y.T
        return z

    code = stampout.capture(fn, torch.randn(3, 3)).gm.code
    assert code.index("_set_grad_enabled(False)") < code.index("mul") < code.index("_set_grad_enabled(True)")
    assert code.index("_enter_autocast") < code.index("matmul") < code.index("_exit_autocast")


GUARD_CODE = """
# region Layer.forward -> subgraph_0 (traced at test_golden.py:LINE in test_guard_code_of_a_region_stack)
def check(leaves, fn, anchors=()):
    v0 = _leaf(leaves, 0)  # self
    if not type(v0) in e0: return False  # class of self: Layer
    if not (isinstance(v0, _Module) and _no_hooks(v0)): return False  # hooks of self: no hooks
    try:
        v2 = a1.__dict__  # Layer.__dict__
    except AttributeError:
        v2 = _MISSING
    try:
        v3 = v2['forward'] if type(v2) in _PLAIN_ITEMS else _item(v2, 'forward')  # Layer.__dict__['forward']
    except (KeyError, IndexError, TypeError):
        v3 = _MISSING
    try:
        v4 = v3.__code__  # Layer.__dict__['forward'].__code__
    except AttributeError:
        v4 = _MISSING
    if not v4 is e2: return False  # object identity of Layer.__dict__['forward'].__code__: <code region.<locals>.call_region at 0x?>
    try:
        v5 = v3.__stampout_region__  # Layer.__dict__['forward'].__stampout_region__
    except AttributeError:
        v5 = _MISSING
    try:
        v6 = v5.fn  # Layer.__dict__['forward'].__stampout_region__.fn
    except AttributeError:
        v6 = _MISSING
    if not v6 is e3: return False  # object identity of Layer.__dict__['forward'].__stampout_region__.fn: <function Layer.forward at 0x?>
    if not ((a7.sentinel or _false)() or a7.unchanged()): return False  # names in namespaces of names read in modules: every name as read
    try:
        v8 = v6.__code__  # Layer.__dict__['forward'].__stampout_region__.fn.__code__
    except AttributeError:
        v8 = _MISSING
    if not v8 is e5: return False  # object identity of Layer.__dict__['forward'].__stampout_region__.fn.__code__: <code Layer.forward at 0x?>
    v9 = _module_attr(v0, 'lin')  # self.lin
    if not type(v9) in e6: return False  # class of self.lin: Linear
    if not (isinstance(v9, _Module) and _no_hooks(v9)): return False  # hooks of self.lin: no hooks
    v10 = _object_dict(v9)  # self.lin.__dict__
    try:
        v11 = v10['forward'] if type(v10) in _PLAIN_ITEMS else _item(v10, 'forward')  # self.lin.__dict__['forward']
    except (KeyError, IndexError, TypeError):
        v11 = _MISSING
    if not (v11 is _MISSING or _is_auto_mark(v11)): return False  # no per-instance override of self.lin.__dict__['forward']: <missing>
    v12 = _module_attr(v9, 'weight')  # self.lin.weight
    pass  # tensor metadata of self.lin.weight: tensor(shape=[4, 4], stride=[4, 1], dtype=torch.float32, device=cpu, requires_grad=True) (checked with the others in one C++ call after this function)
    v13 = _module_attr(v9, 'bias')  # self.lin.bias
    pass  # tensor metadata of self.lin.bias: tensor(shape=[4], stride=[1], dtype=torch.float32, device=cpu, requires_grad=True) (checked with the others in one C++ call after this function)
    return (v12, v13, v12, v13, )
def shared(leaves, fn, anchors=()):  # once per entry, and again after a write to a dict these read
    v0 = fn.__globals__.get('torch', _MISSING)  # globals['torch']
    if not v0 is e0: return False  # object identity of globals['torch']: <module torch at 0x?>
    v2 = mro_attr(a1, 'forward')  # Linear.forward
    if not v2 is e1: return False  # object identity of type(self.lin).forward: <function Linear.forward at 0x?>
    return True
"""  # noqa: E501


def _normalized(text: str) -> str:
    """Guard code without what differs between runs: object addresses, this file's directory, line numbers."""
    import os
    import re

    text = text.replace(os.path.dirname(os.path.abspath(__file__)) + os.sep, "")
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    return re.sub(r"test_golden\.py:\d+", "test_golden.py:LINE", text)


def test_guard_code_of_a_region_stack():
    cap = stampout.capture(nn.Sequential(Layer(), Layer()), torch.randn(2, 4))
    assert _normalized(cap.guard_code()).strip() == GUARD_CODE.strip()


SCALE = 2.0


def scaled(x):
    return torch.relu(x) * SCALE


COMPILED_GUARD_CODE = """
# the full check: after a write to a watched object
def check(leaves, fn, anchors=()):
    v0 = _leaf(leaves, 0)  # self
    if not v0 is e0: return False  # object identity of self: <function scaled at 0x?>
    if not ((a1.sentinel or _false)() or a1.unchanged()): return False  # names in namespaces of names read in modules: every name as read
    try:
        v2 = v0.__code__  # self.__code__
    except AttributeError:
        v2 = _MISSING
    if not v2 is e2: return False  # object identity of self.__code__: <code scaled at 0x?>
    v3 = fn.__globals__.get('torch', _MISSING)  # globals['torch']
    if not v3 is e3: return False  # object identity of globals['torch']: <module torch at 0x?>
    v4 = fn.__globals__.get('SCALE', _MISSING)  # globals['SCALE']
    if not (v4 is not _MISSING and _const_key(v4) == e4): return False  # constant of globals['SCALE']: 2.0
    return True

# every call (then one C++ check of the metadata of the tensors it read)
def check(leaves, fn, anchors=()):
    if not ((a0.sentinel or _false)() or a0.unchanged()): return False  # names in namespaces of names read in modules: every name as read
    v1 = anchors[0]  # self
    try:
        v2 = v1.__code__  # self.__code__
    except AttributeError:
        v2 = _MISSING
    if not v2 is e1: return False  # object identity of self.__code__: <code scaled at 0x?>
    v3 = fn.__globals__.get('torch', _MISSING)  # globals['torch']
    if not v3 is e2: return False  # object identity of globals['torch']: <module torch at 0x?>
    v4 = fn.__globals__.get('SCALE', _MISSING)  # globals['SCALE']
    if not (v4 is not _MISSING and _const_key(v4) == e3): return False  # constant of globals['SCALE']: 2.0
    return ()
"""  # noqa: E501


def test_guard_code_of_a_compiled_function():
    fn = stampout.compile(scaled, backend="eager")
    fn(torch.randn(3))
    assert _normalized(fn.guard_code()).strip() == COMPILED_GUARD_CODE.strip()
