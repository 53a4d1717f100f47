"""A compiled entry's outputs, rebuilt per call from its output template (trace/structure.py) by one generated
function instead of `build`'s walk: containers as literals, and a transformers `ModelOutput` (a decode step's
`CausalLMOutputWithPast`) made as its constructor leaves it rather than by the constructor.

# Note: a ModelOutput without its constructor
The constructor (the BC wrapper of the dataclass `__init__`, `ModelOutput.__setattr__` per field reading
`fields(self)`, `__post_init__`) cost 11-16 us a decode step. What it leaves is an OrderedDict of the fields
that are not None, in field order, and an instance `__dict__` holding every field. Which fields are set and
whether the first one is a tensor decide every branch it takes; everything else it does is registering the
class with torch's pytree once (done by the first call, which runs the constructor). So where the class's
`__new__`, `__init__` (the dataclass one, or transformers' BC wrapper of it), `__setattr__`, `__setitem__` and
`__post_init__` are transformers' own, and the template fixes which fields are set (a hole is a tensor or a
size, an input an object the fingerprint gives its class, a constant itself), the object the first call's
constructor made is recorded: each item and each `__dict__` entry as the template child it came from (by
identity), or None. Later calls make a fresh object with those items and entries (OrderedDict's own
`__setitem__`, then the instance dict) and nothing else. Where anything does not match, the constructor runs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..sources import MISSING
from ..trace.structure import Form, Template, build, from_state, model_output_base, shared_nodes, state_of

_OD_NEW = collections.OrderedDict.__new__
_OD_SETITEM = collections.OrderedDict.__setitem__


class OutputBuilder:
    """`builder(values, leaves)` answers what `build(template, values, leaves)` would: the first call builds it so
    (and derives the generated function from what it built); later calls run the generated function."""

    __slots__ = ("template", "_fast", "_tried")

    def __init__(self, template: Template) -> None:
        self.template = template
        self._fast: Callable[[list, list], Any] | None = None
        self._tried = False

    def __call__(self, values: list[Any], leaves: list[Any]) -> Any:
        fast = self._fast
        if fast is not None:
            return fast(values, leaves)
        out = build(self.template, values, leaves)
        if not self._tried:
            self._tried = True
            try:
                self._fast = _generate(self.template, out, values, leaves)
            except _NoFastPath:
                self._fast = None
        return out


class _NoFastPath(Exception):
    pass


def _model_output(cls: type, items: tuple, attrs: dict) -> Any:
    obj = _OD_NEW(cls)
    for key, value in items:
        _OD_SETITEM(obj, key, value)
    vars(obj).update(attrs)
    return obj


def _generate(template: Template, built: Any, values: list[Any], leaves: list[Any]) -> Callable[[list, list], Any]:
    namespace: dict[str, Any] = {"_model_output": _model_output, "_from_state": from_state}

    def constant(value: Any) -> str:
        name = f"c{len(namespace)}"
        namespace[name] = value
        return name

    shared, named = shared_nodes(template), {}

    def code(node: Template, made: Any) -> str:
        form = node[0]
        if form is Form.HOLE:
            return f"values[{int(node[1])}]"
        if form is Form.INPUT:
            return f"leaves[{int(node[1])}]"
        if form is Form.CONST:
            return constant(node[1])
        if id(node) in shared:  # (one object reached twice: made at its first place, named there)
            if id(node) in named:
                return named[id(node)]
            named[id(node)] = name = f"s{len(named)}"
            return f"({name} := {container(node, made)})"
        return container(node, made)

    def container(node: Template, made: Any) -> str:
        form, t, children = node
        if form is Form.SEQ:
            parts = [code(c, m) for c, m in zip(children, made)]
            if len(parts) != len(children):
                raise _NoFastPath
            if t is tuple:
                return f"({''.join(p + ', ' for p in parts)})"
            if t is list:
                return f"[{', '.join(parts)}]"
            return f"{constant(t)}(({''.join(p + ', ' for p in parts)}))"
        if form is Form.NAMEDTUPLE:
            return f"{constant(t)}({', '.join(code(c, m) for c, m in zip(children, made))})"
        if form is Form.STRUCTSEQ:
            return f"{constant(t)}(({''.join(code(c, m) + ', ' for c, m in zip(children, made))}))"
        if form is Form.STATE:  # (what the first call's object holds, read as from_state puts it back)
            state = dict(state_of(made) or ()) if type(made) is t else {}
            keyed = [(k, code(c, state.get(k, MISSING)), c) for k, c in children]
        else:
            keyed = [(k, code(c, _item(made, k)), c) for k, c in children]
        if form is Form.DICT:
            pairs = "".join(f"({constant(k)}, {expr}), " for k, expr, _ in keyed)
            return f"{constant(t)}(({pairs}))"
        if form is Form.STATE:
            pairs = "".join(f"({constant(k)}, {expr}), " for k, expr, _ in keyed)
            return f"_from_state({constant(t)}, ({pairs}))"
        if form is Form.MODELOUTPUT and model_output_base(t) is not None:
            fast = _recorded(t, children, keyed, values, leaves, constant)
            if fast is not None:
                return fast
        kwargs = "".join(f"**{{{constant(k)}: {expr}}}, " for k, expr, _ in keyed)
        return f"{constant(t)}({kwargs})"

    try:
        body = code(template, built)
    finally:  # (`code` calls itself: its cell would keep this call's outputs and their autograd graphs, which hold
        code = container = None  # the parameters, alive until a collection; torch.utils.swap_tensors refuses such a
        # parameter)
    source = f"def rebuild(values, leaves):\n    return {body}\n"
    exec(compile(source, "<stampout outputs>", "exec"), namespace)
    rebuild = namespace["rebuild"]
    rebuild.source_code = source  # type: ignore[attr-defined]
    return rebuild


def _item(made: Any, key: Any) -> Any:
    try:
        return made[key] if isinstance(made, dict) else getattr(made, key)
    except Exception:  # noqa: BLE001 - only what the code below is derived from: nothing found, no fast path
        return MISSING


def _recorded(t: type, children: tuple, keyed: list, values: list[Any], leaves: list[Any],
              constant: Callable) -> str | None:
    """A ModelOutput of class `t` as a `_model_output` call (see the note), recorded from one its constructor makes
    of this call's values; or None."""
    first = dataclasses.fields(t)[0].name
    given = {k: build(c, values, leaves) for k, c in children}
    settled = any(k != first for k in given) or isinstance(given.get(first), torch.Tensor)
    if not settled:  # (only the first field set, not a tensor: __post_init__ may iterate it)
        return None
    by_id: dict[int, str] = {}
    for (k, value), (_, expr, child) in zip(given.items(), keyed):
        if id(value) in by_id and child[0] is not Form.CONST:
            return None  # (two children one object now: which one a later call's object holds is not known)
        by_id.setdefault(id(value), expr)
    made = t(**given)

    def expr_of(value: Any) -> str | None:
        if id(value) in by_id:
            return by_id[id(value)]
        return "None" if value is None else None

    items = [(k, expr_of(v)) for k, v in collections.OrderedDict.items(made)]
    attrs = [(k, expr_of(v)) for k, v in vars(made).items()]
    if type(made) is not t or any(e is None for _, e in items) or any(e is None for _, e in attrs) \
            or not all(type(k) is str for k, _ in attrs):
        return None
    pairs = "".join(f"({constant(k)}, {e}), " for k, e in items)
    entries = ", ".join(f"{constant(k)}: {e}" for k, e in attrs)
    return f"_model_output({constant(t)}, ({pairs}), {{{entries}}})"
