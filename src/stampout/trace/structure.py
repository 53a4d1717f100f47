"""Pytree structure of call inputs and outputs, without torch's (slow, global) pytree registry.

Inputs are flattened into leaves plus a hashable spec for fingerprints. Outputs become a template
that is rebuilt around new tensors: tuples, lists, dicts, namedtuples, dataclasses and Hugging Face
`ModelOutput`s, with tensors as holes (filled per call) and everything else kept as it was.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import enum
import functools
import gc
import importlib.abc
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import caches, config
from ..sources import mro_attr
from ..torch_internals import FakeTensor
from .memory import memory_span, storages_apart
from .code import user_hashed_key
from .shapes import SIZES, concrete


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def positional_names(fn: Any) -> tuple[str, ...]:
    """The names of `fn`'s positional parameters (`self`, `x`, ...), for labels a user recognizes."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code.co_varnames[:code.co_argcount] if code is not None else ()


def argument_names(fn: Any) -> tuple[str, ...]:
    """The names of the arguments a call of `fn` passes positionally (a module's or bound method's `self` left
    out): `input_ids`, `attention_mask`."""
    import inspect

    names = positional_names(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    return names[1:] if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn) else names


_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})
_OPENED = (tuple, list, dict)  # (what flatten_inputs may open: anything else is a leaf)


def opened_dict(value: dict) -> bool:
    """Whether an input dict is opened into its items (flatten_inputs, rebuild_inputs): not one keyed by objects whose
    `__hash__`/`__eq__` is the user's Python (its keys in the spec would be hashed on every call), nor an instance of a
    dict subclass that holds more than its items (`_fields_beyond_items`): each is a leaf."""
    return user_hashed_key(value) is None and (type(value) is dict or not _fields_beyond_items(value))


def _fields_beyond_items(value: dict) -> bool:
    """Whether a dict subclass instance has an attribute that is not None and not its item of that name: the spec
    holds the items only, and the trace reads a copy (rebuild_inputs), so such a field (`d.only = "a"`, read by the
    class's own `__iter__`) would be baked. A ModelOutput's fields mirror its items (None ones are not items)."""
    fields = getattr(value, "__dict__", None)
    return bool(fields) and any(v is not None and dict.get(value, k, _ABSENT) is not v for k, v in fields.items())


_ABSENT = object()


def flatten_inputs(args: tuple, kwargs: dict, names: tuple[str, ...] = ()) -> tuple[list[Any], tuple, list[str]]:
    """Leaves of `(args, kwargs)` (containers opened: tuple, list, dict, namedtuple), a spec and labels.

    Labels name positional arguments after `names` where given (`self`, `hidden_states[0]`), else `args[i]`.
    (Run on every compiled call: where no argument is a tuple, list or dict, each is a leaf, the walk's answer, taken
    without it; else plain leaves, the common case, are taken by the walk's first test.)"""
    for value in (*args, *kwargs.values()):
        if type(value) not in _PLAIN_LEAVES and isinstance(value, _OPENED):
            break
    else:
        labels = [names[i] if i < len(names) else f"args[{i}]" for i in range(len(args))] if args else []
        labels += kwargs
        return [*args, *kwargs.values()], ((None,) * len(args), tuple([(k, None) for k in kwargs])), labels
    leaves: list[Any] = []
    labels: list[str] = []

    def walk(value: Any, label: str) -> Any:
        t = type(value)
        if t in _PLAIN_LEAVES:
            leaves.append(value)
            labels.append(label)
            return None
        if t is tuple or t is list or _is_namedtuple(value):
            return (t, tuple([walk(v, f"{label}[{i}]") for i, v in enumerate(value)]))
        if isinstance(value, dict) and opened_dict(value):  # OrderedDict and Hugging Face ModelOutput too: their
            # items are inputs; a defaultdict's factory (a C field: what a missing key reads) by identity
            kind = (t, value.default_factory) if isinstance(value, collections.defaultdict) else t
            return (kind, tuple([(k, walk(v, f"{label}[{k!r}]")) for k, v in value.items()]))
        leaves.append(value)
        labels.append(label)
        return None

    spec = (
        tuple([walk(a, names[i] if i < len(names) else f"args[{i}]") for i, a in enumerate(args)]),
        tuple([(k, walk(v, k)) for k, v in kwargs.items()]),
    )
    return leaves, spec, labels


# Note: the one walker over an op's arguments and results: tuples, lists and dicts (subclasses too), in
# order, as fx's map_aggregate walks a node's. Walkers that carry a source per item (held_inputs, leftovers,
# effects, names), look into objects' fields (tensors_within, holds_fake), or keep to what an FX
# node's arguments may hold (builder.map_tensors and has_tensor, with slices; both open namedtuples and
# structseqs) differ by purpose and stay where they are.
def leaves_of(value: Any, kind: type | tuple[type, ...]) -> list[Any]:
    """Every instance of `kind` inside the tuples, lists and dicts of `value` (an op's arguments or results)."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves_of(v, kind)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves_of(v, kind)]
    return []


def map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with each leaf inside its tuples, lists and dicts replaced by `fn(leaf)` (the same walk as
    `leaves_of`; a dict comes back a dict, a namedtuple the same namedtuple)."""
    if isinstance(value, (tuple, list)):
        items = [map_leaves(v, fn) for v in value]
        return type(value)._make(items) if hasattr(type(value), "_make") else type(value)(items)
    if isinstance(value, dict):
        return {k: map_leaves(v, fn) for k, v in value.items()}
    return fn(value)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor inside tuples, lists and dicts of `value` (an op's arguments or results)."""
    return leaves_of(value, torch.Tensor)


def aliases_of(leaves: list[Any]) -> tuple:
    """For each leaf, the index of the first leaf that is the same object (which inputs alias); then, when
    distinct tensors share a storage (`base[:5]` and `base[1:]`, `x` and `x.detach()` or `x.data`), the pairs
    whose bytes may overlap, so an in-place op traced on disjoint inputs is not reused on overlapping ones. Real
    tensors share memory by their storages' bytes: two storages over one array (`torch.from_numpy`) overlap."""
    try:  # the common case: distinct objects, the tensors in storages of their own (one lookup each)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        if len(tensors) < 2 and len(set(map(id, leaves))) == len(leaves):
            return tuple(range(len(leaves)))  # (no two tensors: no memory shared, no storage looked up)
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        if len({s._cdata for s in storages}) == len(tensors) and storages_apart(tensors, storages) \
                and (len(tensors) == len(leaves) or len(set(map(id, leaves))) == len(leaves)):
            return tuple(range(len(leaves)))
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a storage
        pass
    first: dict[int, int] = {}
    same = tuple(first.setdefault(id(leaf), i) for i, leaf in enumerate(leaves))
    overlaps = _overlaps(leaves, [i for i in first.values() if isinstance(leaves[i], torch.Tensor)])
    return same + (overlaps,) if overlaps else same


def show_aliases(aliases: tuple, names: list[str]) -> str:
    """An `aliases_of` answer as a user reads it, the leaves named by `names`: "x is globals['G']; a and b
    share memory", or "all apart"."""
    overlaps = aliases[-1] if aliases and isinstance(aliases[-1], tuple) else ()
    same = aliases[:-1] if overlaps else aliases

    def name(i: int) -> str:
        return names[i] if i < len(names) else f"tensor {i}"

    parts = [f"{name(i)} is {name(first)}" for i, first in enumerate(same) if first != i]
    parts += [f"{name(i)} and {name(j)} share memory" for i, j in overlaps]
    return "; ".join(parts) or "all apart"


def _storage(t: torch.Tensor) -> int:
    """An identity of the memory `t` lives in: its storage (shared by views, `detach()`, `.data`), or for a
    tensor without one (sparse, a wrapper subclass) the tensor itself."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


def _overlaps(leaves: list[Any], tensors: list[int]) -> tuple[tuple[int, int], ...]:
    """Pairs (earlier, later) of the distinct tensor leaves at `tensors` whose memory is shared (one storage, or
    storages over the same bytes) and whose bytes may overlap."""
    keys = [_storage(leaves[i]) for i in tensors]
    spans = [memory_span(leaves[i]) for i in tensors]
    starts = {key: span[0] for key, span in zip(keys, spans) if span is not None}
    group: dict[int, int] = {}  # storage -> the first storage of the memory it shares
    first, reach = None, 0
    for (start, end), key in sorted((span, key) for span, key in zip(spans, keys) if span is not None):
        if first is None or start >= reach:
            first, reach = key, end
        group[key] = first
        reach = max(reach, end)
    if len(set(keys)) == len(keys) and len(set(group.values())) == len(group):
        return ()
    members: dict[int, list[int]] = {}
    pairs = []
    for i, key in zip(tensors, keys):
        same = members.setdefault(group.get(key, key), [])
        pairs.extend((j, i) for j in same
                     if _may_overlap(leaves[j], leaves[i], starts.get(key, 0) - starts.get(_storage(leaves[j]), 0)))
        same.append(i)
    return tuple(sorted(pairs))


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Sizes, strides and storage offset as ints: a fake of a dynamic capture's by its sizes for the capture's
    own inputs (no guard: comparing the symbols would specialize them)."""
    if getattr(t, "_has_symbolic_sizes_strides", False):
        return tuple(concrete(tuple(t.shape))), tuple(concrete(t.stride())), concrete(t.storage_offset())
    return tuple(t.shape), t.stride(), t.storage_offset()


def _may_overlap(a: torch.Tensor, b: torch.Tensor, shift: int = 0) -> bool:
    """Whether two strided views of one memory may share an element, `b`'s storage starting `shift` bytes after
    `a`'s: exact for views with the same sizes and strides laid out without self-overlap (the halves of a
    split); otherwise by their byte ranges."""
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return True
    try:
        (shape_a, stride_a, offset_a), (shape_b, stride_b, offset_b) = _layout(a), _layout(b)
    except (TypeError, ValueError, RuntimeError):  # (a size without a value to compare by)
        return True
    if 0 in shape_a or 0 in shape_b:
        return False

    def span(shape, stride, offset, size) -> tuple[int, int]:
        return offset * size, (offset + 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride))) * size

    (s0, e0) = span(shape_a, stride_a, offset_a, a.element_size())
    (s1, e1) = span(shape_b, stride_b, offset_b, b.element_size())
    s1, e1 = s1 + shift, e1 + shift
    if not (s0 < e1 and s1 < e0):
        return False
    if shape_a != shape_b or stride_a != stride_b or a.dtype != b.dtype:
        return True
    dims = sorted((s, n) for n, s in zip(shape_a, stride_a) if n > 1)
    reach = 0
    for s, n in dims:  # innermost first: each stride must pass everything inside it
        if s <= reach:
            return True
        reach += (n - 1) * s
    distance, part = divmod((offset_b - offset_a) * a.element_size() + shift, a.element_size())
    return part != 0 or _reachable(distance, dims[::-1])


def _reachable(d: int, dims: list[tuple[int, int]]) -> bool:
    """Whether d = sum(k * stride) with |k| < size for each (stride, size), strides nested (largest first)."""
    if not dims:
        return d == 0
    (s, n), rest = dims[0], dims[1:]
    for k in {d // s, -((-d) // s)}:
        if abs(k) < n and _reachable(d - k * s, rest):
            return True
    return False


class Form(enum.IntEnum):
    """What a node of an output template is: the kind leading its tuple. A template is a tree of tuples
    `(Form.HOLE, i)` (the i-th value filled in per call: a tensor, or a size the graph computes),
    `(Form.INPUT, i)` (the call's i-th input leaf: an object the call was given and returns, such as a KV cache;
    each call returns its own), `(Form.CONST, value)`, or `(form, type, children)` for a container. (An
    IntEnum: `build` runs on every compiled call and compares these by identity.)"""

    HOLE = 0
    INPUT = 1
    CONST = 2
    SEQ = 3  # tuple, list or torch.Size: children in order
    NAMEDTUPLE = 4
    STRUCTSEQ = 5  # torch.return_types.max
    MODELOUTPUT = 6  # transformers' ModelOutput: (key, child) pairs of its set keys
    DATACLASS = 7  # (field name, child) pairs of its init fields
    DICT = 8  # dict or OrderedDict: (key, child) pairs
    STATE = 9  # a dataclass whose constructor does more than store its fields: ((where, name), child) pairs of
    #            its state as the trace left it (where: "attr", "slot" or "item"), put back without the constructor


_HOLE, _INPUT, _CONST = Form.HOLE, Form.INPUT, Form.CONST
_SEQ, _NAMEDTUPLE, _STRUCTSEQ = Form.SEQ, Form.NAMEDTUPLE, Form.STRUCTSEQ
_DICT, _STATE = Form.DICT, Form.STATE
_KEYED = frozenset((Form.MODELOUTPUT, Form.DATACLASS, Form.DICT, Form.STATE))  # children are (key, child) pairs
Template = tuple


def to_template(value: Any, holes: list[Any], inputs: dict[int, int] | None = None, sizes: bool = False,
                world: Any = (), memo: dict[int, Template] | None = None) -> Template:
    """The template of `value`, appending each tensor it holds (and with `sizes`, each symbolic size: the
    graph computes it) to `holes`; `inputs` maps the id of each input object (not a tensor or constant) to
    its leaf index. A dataclass instance whose id is in `world` (read by the program from its model, globals or
    closures: `return y, self.config`) and that holds no fake is that very object (a constant), not one rebuilt.
    A mutable container reached twice (`return held, held`, a dataclass's `self.alias = self.items`) is one node
    reached twice (`memo`: id -> node), which `build` makes one object (see shared_nodes)."""
    if isinstance(value, torch.Tensor) or sizes and isinstance(value, SIZES):
        holes.append(value)
        return (Form.HOLE, len(holes) - 1)
    if inputs and id(value) in inputs:
        return (Form.INPUT, inputs[id(value)])
    if id(value) in world and (dataclasses.is_dataclass(value) and not isinstance(value, type)
                               and not fakes_within(value) or type(value) in _HELD):
        return (Form.CONST, value)  # (a list or dict of the world's: that object, see keep_held_outputs)
    memo = {} if memo is None else memo
    node = memo.get(id(value))
    if node is None:
        node = _to_template(value, holes, lambda v: to_template(v, holes, inputs, sizes, world, memo))
        if node[0] is not _CONST and not isinstance(value, tuple):  # (a tuple is made again as an equal one)
            memo[id(value)] = node
    return node


_HELD = frozenset((list, dict, set, collections.OrderedDict, collections.defaultdict))


def shared_nodes(template: Template) -> set[int]:
    """The ids of the container nodes `template` reaches more than once (one object in the output it describes)."""
    seen: set[int] = set()
    shared: set[int] = set()

    def walk(node: Template) -> None:
        if node[0] is _HOLE or node[0] is _INPUT or node[0] is _CONST:
            return
        if id(node) in seen:
            shared.add(id(node))
            return
        seen.add(id(node))
        for child in node[2]:
            walk(child[1] if node[0] in _KEYED else child)

    walk(template)
    return shared


def _to_template(value: Any, holes: list[Any], to_template: Any) -> Template:
    t = type(value)
    if t is tuple or t is list or t is torch.Size or t is set:  # (a set made by the call: a new one per call)
        return (Form.SEQ, t, tuple(to_template(v) for v in value))
    if _is_namedtuple(value):
        return (Form.NAMEDTUPLE, t, tuple(to_template(v) for v in value))
    if isinstance(value, tuple) and hasattr(t, "n_fields"):  # a structseq: torch.return_types.max
        return (Form.STRUCTSEQ, t, tuple(to_template(v) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not stores_fields(t):
            state = state_of(value)
            if state is not None:
                return (Form.STATE, t, tuple((key, to_template(v)) for key, v in state))
        if isinstance(value, dict):  # transformers' ModelOutput: a dict whose set keys are its fields
            items = tuple((k, to_template(v)) for k, v in value.items())
            return (Form.MODELOUTPUT, t, items)
        fields = tuple(
            (f.name, to_template(getattr(value, f.name))) for f in dataclasses.fields(value) if f.init
        )
        return (Form.DATACLASS, t, fields)
    if t is dict or t is collections.OrderedDict or _plain_dict_subclass(value):
        return (Form.DICT, t, tuple((k, to_template(v)) for k, v in value.items()))
    return (Form.CONST, value)


def stores_fields(t: type) -> bool:
    """Whether `t(**fields)` makes again what a call made: the dataclass-generated `__init__` (or transformers'
    ModelOutput's machinery) with no `__post_init__` of the user's (one that changes a field, `self.y = self.y * 2`,
    would change it twice: once in the trace, once in the rebuild)."""
    if isinstance(t, type) and issubclass(t, dict):
        return model_output_base(t) is not None
    if mro_attr(t, "__new__") is not object.__new__ or hasattr(t, "__post_init__"):
        return False
    return _generated_init(mro_attr(t, "__init__"))


def _generated_init(init: Any) -> bool:
    code = getattr(init, "__code__", None)
    named = getattr(init, "__qualname__", "").endswith(".__init__")
    return code is not None and code.co_filename == "<string>" and named


def model_output_base(cls: type) -> type | None:
    """transformers' ModelOutput base of `cls`, where `cls` keeps its constructor's machinery: `__new__`,
    `__setattr__`, `__setitem__`, `__post_init__`, `__getattribute__` and `__init_subclass__` are ModelOutput's and
    `__init__` is the dataclass-generated one or the metaclass's BC wrapper around it; else None."""
    base = next((k for k in cls.__mro__
                 if k.__name__ == "ModelOutput" and k.__module__ == "transformers.utils.generic"), None)
    if base is None or not dataclasses.is_dataclass(cls) or not issubclass(cls, collections.OrderedDict):
        return None
    if mro_attr(cls, "__new__") is not mro_attr(collections.OrderedDict, "__new__"):
        return None
    for name in ("__setattr__", "__setitem__", "__post_init__", "__getattribute__", "__init_subclass__"):
        if mro_attr(cls, name) is not mro_attr(base, name):
            return None
    init = mro_attr(cls, "__init__")
    inner = getattr(init, "__wrapped__", init)
    if not _generated_init(inner):
        return None  # (not the dataclass-generated __init__ or its BC wrapper)
    if init is not inner and getattr(init, "__code__", None) not in _bc_wrappers(type(base)):
        return None
    return base


def _bc_wrappers(meta: type) -> tuple:
    """The code of the `__init__` wrapper(s) transformers' ModelOutput metaclass puts around a dataclass `__init__`
    (renaming old keyword arguments), as constants of the metaclass's own methods."""
    return tuple(c for f in vars(meta).values() for c in getattr(getattr(f, "__code__", None), "co_consts", ())
                 if isinstance(c, types.CodeType) and c.co_name == "__init__")


def state_of(value: Any) -> list[tuple[tuple[str, Any], Any]] | None:
    """The state of a dataclass instance as `from_state` puts it back: its instance attributes, `__slots__` fields
    and (a dict subclass) items; None where it cannot be (a `__new__` of its own, a non-str attribute name)."""
    t = type(value)
    base = collections.OrderedDict if isinstance(value, collections.OrderedDict) else dict
    if mro_attr(t, "__new__") not in (object.__new__, mro_attr(base, "__new__")):
        return None
    fields = getattr(value, "__dict__", {})
    if type(fields) is not dict or not all(type(k) is str for k in fields):
        return None
    state: list[tuple[tuple[str, Any], Any]] = [(("attr", k), v) for k, v in fields.items()]
    for klass in t.__mro__:
        state += [(("slot", n), getattr(value, n)) for n in slot_fields(klass) if hasattr(value, n)]
    if isinstance(value, dict):
        state += [(("item", k), v) for k, v in base.items(value)]
    return state


def from_state(t: type, state: Any) -> Any:
    """An instance of `t` holding `state` ((where, name), value) pairs, made without its constructor (`state_of`)."""
    ordered = issubclass(t, collections.OrderedDict)
    obj = (collections.OrderedDict.__new__ if ordered else dict.__new__ if issubclass(t, dict) else object.__new__)(t)
    put = collections.OrderedDict.__setitem__ if ordered else dict.__setitem__
    fields = getattr(obj, "__dict__", None)
    for (where, name), value in state:
        if where == "attr":
            fields[name] = value
        elif where == "slot":
            object.__setattr__(obj, name, value)
        else:
            put(obj, name, value)
    return obj


def _plain_dict_subclass(value: Any) -> bool:
    """A user's dict or OrderedDict subclass that `t(pairs)` makes again whole (`class Output(OrderedDict)` with
    a `__getattr__`): the constructor and `__new__` are the dict's, and the instance holds no attributes (none in
    a `__dict__`, no `__slots__` field of its classes: `t(pairs)` would leave them unset)."""
    t = type(value)
    return (isinstance(value, dict) and t.__init__ in (dict.__init__, collections.OrderedDict.__init__)
            and t.__new__ in (dict.__new__, collections.OrderedDict.__new__) and not getattr(value, "__dict__", None)
            and not any(slot_fields(klass) for klass in t.__mro__))


def slot_fields(klass: type) -> list[str]:
    """The fields `klass` itself declares in `__slots__` (a string is one name), less `__dict__` and `__weakref__`."""
    slots = vars(klass).get("__slots__", ())
    return [s for s in ((slots,) if isinstance(slots, str) else slots) if s not in ("__dict__", "__weakref__")]


def build(template: Template, values: list[Any], leaves: list[Any] = (), made: dict[int, Any] | None = None) -> Any:
    """Rebuild the structure of `template` with `values[i]` in hole i and the call's input leaf `leaves[i]`
    where the template returns input i; a node reached twice is one object (`made`: id of node -> object)."""
    form = template[0]
    if form is _HOLE:
        return values[template[1]]
    if form is _CONST:
        return template[1]
    if form is _INPUT:
        return leaves[template[1]]
    made = {} if made is None else made
    out = made.get(id(template), _NOTHING)
    if out is _NOTHING:
        out = made[id(template)] = _build(form, template[1], template[2], values, leaves, made)
    return out


_NOTHING = object()


def _build(form: Form, t: type, children: tuple, values: list[Any], leaves: list[Any], made: dict[int, Any]) -> Any:
    if form is _SEQ:
        return t(build(c, values, leaves, made) for c in children)
    if form is _NAMEDTUPLE:
        return t(*(build(c, values, leaves, made) for c in children))
    if form is _STRUCTSEQ:
        return t(tuple(build(c, values, leaves, made) for c in children))
    if form is _STATE:
        return from_state(t, [(k, build(c, values, leaves, made)) for k, c in children])
    if form is not _DICT:  # a ModelOutput or dataclass
        return t(**{k: build(c, values, leaves, made) for k, c in children})
    return t((k, build(c, values, leaves, made)) for k, c in children)


def template_constants(template: Template) -> list[Any]:
    """Every constant leaf of a template (not a hole or input)."""
    form = template[0]
    if form is _HOLE or form is _INPUT:
        return []
    if form is _CONST:
        return [template[1]]
    out: list[Any] = []
    for child in template[2]:
        out.extend(template_constants(child[1] if form in _KEYED else child))
    return out


ATOMIC = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device))


_NOT_PLAIN = (torch.nn.Module, torch.Tensor, type, types.ModuleType)


def plain_fields(value: Any) -> dict | None:
    """The attributes of a plain object: a user object with attributes of its own (not a module, tensor,
    class, function or namespace); None for anything else."""
    fields = getattr(value, "__dict__", None)
    return fields if type(fields) is dict and not callable(value) and not isinstance(value, _NOT_PLAIN) else None


def plain_object(value: Any) -> bool:
    return plain_fields(value) is not None


@functools.lru_cache(maxsize=1024)
def public_names(keys: tuple) -> tuple:
    """The names among an instance dict's keys that do not start with `_` (what a caller or a program set, `x.scale`,
    `self.heads`; not a module's registries and flags, a fake's own fields), in order. Memoized on the keys alone
    (never stale): the instances of one class share them."""
    return tuple(k for k in keys if not k.startswith("_"))


caches.register(public_names, "structure public attribute names")


def found_within(value: Any, wanted: Callable[[Any], bool], depth: int | None = None, items: int | None = None,
                 first: bool = False, whole: bool = False, clean: dict[int, Any] | None = None) -> list[Any]:
    """The one walk over the values a value holds: each one `wanted` accepts, in order (`value` itself first;
    what it accepts is not opened; `first`: only the first). It opens lists, tuples, sets, dicts (their values)
    and the attributes of plain objects (plain_object), `depth` levels deep, and leaves shut a container of more
    than `items` items (both None: config.scan_depth and config.scan_items) and every other value.

    `whole`: everything the value reaches, each object once, at any depth, however many items, through any
    Python object (`referents`: modules, closures, bound methods, partials, __slots__, dict keys, iterators); for
    what a capture hands back or leaves behind, where one missed fake is a fake the caller holds. `clean` (whole
    walks of one pass with one `wanted`, over objects the pass does not add to): the objects a walk of it went all
    through without finding anything, by id; later walks skip them (see Note: clean objects)."""
    if whole:
        return _reached(value, wanted, first, clean)
    depth = config.scan_depth if depth is None else depth
    items = config.scan_items if items is None else items
    found: list[Any] = []

    def walk(v: Any, level: int) -> bool:  # (True: stop, the first is found)
        t = type(v)
        if t in ATOMIC:  # (most values a module or config holds: no isinstance walk for them)
            return False
        if wanted(v):
            found.append(v)
            return first
        if level >= depth:
            return False
        if t in (list, tuple, set, frozenset):
            inside = v
        elif isinstance(v, (list, tuple)):
            inside = _base_items(v)  # (not a subclass's own Python: see referents)
        elif isinstance(v, dict):
            inside = dict.values(v)
        else:
            fields = plain_fields(v)
            if fields is None:
                return False
            inside = fields.values()
        if len(inside) <= items:
            for inner in list(inside):
                if walk(inner, level + 1):
                    return True
        return False

    walk(value, 0)
    return found


# Note: clean objects
# A pass that asks of many values whether they hold a fake (each item of every memo container, each field of every
# object a capture touched) would walk what they share (a model every layer's closure reaches) once per value. A
# whole walk that ends without finding anything went through all that each object it saw reaches: none of them
# reaches a wanted value, so a later walk of the same pass may skip them. Valid while the pass adds no wanted value
# to what it walked (the repairs only take fakes out) and for one `wanted`.
def _reached(value: Any, wanted: Callable[[Any], bool], first: bool, clean: dict[int, Any] | None) -> list[Any]:
    found: list[Any] = []
    seen: dict[int, Any] = {}  # (by id, kept alive meanwhile)
    skip = clean if clean is not None else {}
    # A walk for fakes passes over real tensors (a model's parameters: most of what a module tree holds) as over
    # atomic values: not wanted, and a tensor is a stop (referents: none)
    fakes = wanted is _fake or wanted is _fake_or_symbolic
    passed = _PASSED_FOR_FAKES if fakes else ATOMIC
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t in passed or id(v) in seen or id(v) in skip:
            continue
        seen[id(v)] = v
        if fakes and t is dict:  # (most of what a model holds: no fake, no symbolic size; opened as referents does)
            inside = _dict_items(v)
        elif fakes and (_MODULE_CLASSES.get(t) if t in _MODULE_CLASSES else _module_class(t)):  # (see _module_class)
            inside = _module_fields(v)
        elif wanted(v):
            found.append(v)
            if first:
                break
            continue
        else:
            inside = referents(v)
        if len(inside) < 64 or not ATOMIC.issuperset(map(type, inside)):  # (a vocabulary's strings and ids: one
            stack.extend(reversed(inside))  # pass in C)
    if clean is not None and not found:
        clean.update(seen)
    return found


# Where the whole walk stops: what holds no user state of the call (classes, Python modules, code, frames: a
# frame leads up the stack), tensors (a fake is found by `wanted`, a real one is a leaf), and torch's internal
# objects (torch._*, torch.fx) and stampout's (a shape environment, a graph, a tracer: they hold fakes by design).
_STOPS = (type, types.ModuleType, types.CodeType, types.FrameType, torch.Tensor)
_OWN = ("torch.", "stampout.")  # (functions)
_INTERNAL = ("torch._", "torch.fx.", "stampout.")  # (objects: a torch.distributions.Normal a program returns is opened)
# A module's registries, hook dicts and `_non_persistent_buffers_set`: empty, they hold nothing to walk
_EMPTIES = frozenset((dict, collections.OrderedDict, set))
# The import system's loaders and finders (a module's globals name its `__loader__`; pytest's loader reaches its
# session), the logging registry (a logger's `manager`: every logger, ~400 under transformers) and `__builtins__`: no
# program state (a logger is opened). A module's `__spec__` is opened: a store on it (`mod.__spec__.h = h`) is found.
_IMPORT_SYSTEM = (importlib.abc.Loader, importlib.abc.MetaPathFinder, importlib.abc.PathEntryFinder, logging.Manager)
_BUILTINS = vars(builtins)


_SHUT: dict[type, bool] = caches.register({}, "structure classes the whole walk leaves shut")


def _shut(t: type) -> bool:
    """Whether the whole walk leaves objects of class `t` shut: torch's and stampout's internal ones, and the
    import system's (and the logging system's registry)."""
    shut = _SHUT.get(t)
    if shut is None:
        shut = _SHUT[t] = t.__module__.startswith(_INTERNAL) or issubclass(t, _IMPORT_SYSTEM)
    return shut


def referents(v: Any) -> list[Any]:
    """The values `v` holds, as the whole walk opens them: a container's items (a dict's keys and values), a
    function's closure cells and defaults (not its globals: the whole program), a bound method's object and
    function, a module's __dict__ (parameters, buffers, submodules, hooks), and for any other object what the
    garbage collector sees it hold (its __dict__, __slots__, a partial's arguments, an iterator's sequence)."""
    t = type(v)
    if t is list or t is tuple or t is set or t is frozenset:
        return list(v)
    if t is dict:
        return _dict_items(v)
    if isinstance(v, _STOPS):
        return []
    if t is types.FunctionType:
        if v.__module__ and v.__module__.startswith(_OWN):
            return []
        cells = [x for c in v.__closure__ or () for x in _contents(c)]
        return [*cells, v.__defaults__, v.__kwdefaults__, v.__dict__]
    if t is types.CellType:
        return _contents(v)
    if isinstance(v, torch.nn.Module):
        return _module_fields(v)
    if isinstance(v, (dict, list, tuple, set, frozenset)):  # (a subclass: a namedtuple, torch.return_types, a
        fields = getattr(v, "__dict__", None)  # ModelOutput; its attributes too. Read by the base class's C
        # methods: a subclass's own `__getitem__` or `__iter__` is the user's Python, which may make things, as
        # transformers' ACT2FN makes a new activation module per item read)
        inside = [*dict.keys(v), *dict.values(v)] if isinstance(v, dict) else _base_items(v)
        return [*inside, *(fields.values() if type(fields) is dict else ())]
    return [] if _shut(t) else gc.get_referents(v)


def _dict_items(v: dict) -> list[Any]:
    return [] if "__builtins__" in v or v is _BUILTINS else [*v.keys(), *v.values()]  # (globals: the program)


def _module_fields(v: torch.nn.Module) -> list[Any]:
    """A module's fields by name, less flags and empty hook dicts and sets (quicker than all its referents)."""
    return [x for x in v.__dict__.values() if (t := type(x)) not in ATOMIC and (t not in _EMPTIES or x)]


_MODULE_CLASSES: dict[type, bool] = caches.register({}, "structure module classes the fakes walk opens directly")


def _module_class(t: type) -> bool:
    """Whether every object of exact class `t` is a module that neither fakes predicate accepts and that referents
    opens by its fields: a subclass of nn.Module, of no class in _STOPS or _FAKE_CLASSES, and none of its classes
    defining `__class__` (isinstance would also ask the object's `__class__`). Remembered per class."""
    opened = _MODULE_CLASSES[t] = (issubclass(t, torch.nn.Module) and not issubclass(t, (*_STOPS, *_FAKE_CLASSES))
                                   and not any("__class__" in vars(k) for k in t.__mro__[:-1]))
    return opened


def _base_items(v: list | tuple | set | frozenset) -> list[Any]:
    """The items of a container subclass as its C base class holds them (no Python `__iter__` of the subclass)."""
    for base in (list, tuple, set, frozenset):
        if isinstance(v, base):
            return list(base.__iter__(v))
    return []


def _contents(cell: Any) -> list[Any]:
    try:
        return [cell.cell_contents]
    except ValueError:  # (an empty cell: a variable not bound yet)
        return []


_PASSED_FOR_FAKES = ATOMIC | {torch.Tensor, torch.nn.Parameter}  # (exact classes: a fake's is FakeTensor, also as a
# Parameter made of a fake)


def tensors_within(value: Any) -> list[torch.Tensor]:
    """Every tensor `value` reaches (the whole walk: see found_within): the tensors a region's code left outside
    its outputs (regions/trace.py) must all be found, in a callable object or a module it made as well."""
    return found_within(value, lambda v: isinstance(v, torch.Tensor), whole=True)


def _fake(v: Any) -> bool:
    return type(v) is FakeTensor or isinstance(v, FakeTensor)


_FAKE_CLASSES = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def _fake_or_symbolic(v: Any) -> bool:
    return type(v) is FakeTensor or isinstance(v, _FAKE_CLASSES)


def fakes_within(value: Any) -> list[Any]:
    """Every FakeTensor `value` reaches (the whole walk: see found_within)."""
    return found_within(value, _fake, whole=True)


def holds_fake(value: Any, tensors_only: bool = False, whole: bool = False,
               clean: dict[int, Any] | None = None) -> bool:
    """Whether a FakeTensor (or, unless `tensors_only`, a symbolic size) is inside `value` (see found_within;
    `whole`: anywhere it reaches; `clean`: see found_within, for one pass of the same `tensors_only`)."""
    if type(value) in ATOMIC:
        return False
    return bool(found_within(value, _fake if tensors_only else _fake_or_symbolic, first=True, whole=whole,
                             clean=clean))


def holds_traced_tensor(fn: Any) -> bool:
    """Whether a callable closes over (or defaults to, or is bound to) a fake tensor of the capture."""
    parts = [getattr(fn, "__self__", None), getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            parts.append(cell.cell_contents)
        except ValueError:
            continue
    if isinstance(fn, functools.partial):
        parts.extend([fn.func, fn.args, fn.keywords])
    return any(holds_fake(p, tensors_only=True) for p in parts if p is not None)
