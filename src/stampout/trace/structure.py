"""Pytree structure of call inputs and outputs, without torch's (slow, global) pytree registry.

Inputs are flattened into leaves plus a hashable spec for fingerprints. Outputs become a template
that is rebuilt around new tensors: tuples, lists, dicts, namedtuples, dataclasses and Hugging Face
`ModelOutput`s, with tensors as slots and everything else kept as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..torch_internals import FakeTensor
from .memory import memory_span, storages_apart
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


def flatten_inputs(args: tuple, kwargs: dict, names: tuple[str, ...] = ()) -> tuple[list[Any], tuple, list[str]]:
    """Leaves of `(args, kwargs)` (containers opened: tuple, list, dict, namedtuple), a spec and labels.

    Labels name positional arguments after `names` where given (`self`, `hidden_states[0]`), else `args[i]`.
    (Run on every compiled call: plain leaves, the common case, are taken by the first test.)"""
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
        if isinstance(value, dict):  # OrderedDict and Hugging Face ModelOutput too: their items are inputs
            return (t, tuple([(k, walk(v, f"{label}[{k!r}]")) for k, v in value.items()]))
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
    try:  # the common case, all tensors in storages of their own: one storage lookup each, no id pass
        storages = list(map(torch.Tensor.untyped_storage, leaves))
        if len({s._cdata for s in storages}) == len(storages) and storages_apart(leaves, storages):
            return tuple(range(len(storages)))
    except (RuntimeError, NotImplementedError, TypeError):  # a leaf that is not a tensor or has no storage
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


# Output templates: a tree of tuples; ("slot", i) marks the i-th tensor, ("input", i) the call's i-th input leaf
# (an object the call was given and returns, such as a KV cache: each call returns its own).
Template = tuple


def to_template(value: Any, slots: list[Any], inputs: dict[int, int] | None = None, sizes: bool = False) -> Template:
    """The template of `value`, appending each tensor it holds (and with `sizes`, each symbolic size: the
    graph computes it) to `slots`; `inputs` maps the id of each input object (not a tensor or constant) to
    its leaf index."""
    if isinstance(value, torch.Tensor) or sizes and isinstance(value, SIZES):
        slots.append(value)
        return ("slot", len(slots) - 1)
    if inputs and id(value) in inputs:
        return ("input", inputs[id(value)])
    return _to_template(value, slots, lambda v: to_template(v, slots, inputs, sizes))


def _to_template(value: Any, slots: list[Any], to_template: Any) -> Template:
    t = type(value)
    if t is tuple or t is list or t is torch.Size:
        return ("seq", t, tuple(to_template(v) for v in value))
    if _is_namedtuple(value):
        return ("namedtuple", t, tuple(to_template(v) for v in value))
    if isinstance(value, tuple) and hasattr(t, "n_fields"):  # a structseq: torch.return_types.max
        return ("structseq", t, tuple(to_template(v) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, dict):  # transformers' ModelOutput: a dict whose set keys are its fields
            items = tuple((k, to_template(v)) for k, v in value.items())
            return ("modeloutput", t, items)
        fields = tuple(
            (f.name, to_template(getattr(value, f.name))) for f in dataclasses.fields(value) if f.init
        )
        return ("dataclass", t, fields)
    if t is dict or t is collections.OrderedDict:
        return ("dict", t, tuple((k, to_template(v)) for k, v in value.items()))
    return ("const", value)


def build(template: Template, values: list[Any], leaves: list[Any] = ()) -> Any:
    """Rebuild the structure of `template` with `values[i]` in slot i and the call's input leaf `leaves[i]`
    where the template returns input i."""
    kind = template[0]
    if kind == "slot":
        return values[template[1]]
    if kind == "const":
        return template[1]
    if kind == "input":
        return leaves[template[1]]
    t, children = template[1], template[2]
    if kind == "seq":
        return t(build(c, values, leaves) for c in children)
    if kind == "namedtuple":
        return t(*(build(c, values, leaves) for c in children))
    if kind == "structseq":
        return t(tuple(build(c, values, leaves) for c in children))
    if kind in ("modeloutput", "dataclass"):
        return t(**{k: build(c, values, leaves) for k, c in children})
    return t((k, build(c, values, leaves)) for k, c in children)


def tensors_within(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside containers and plain objects' attributes (a few levels deep)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_within(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_within(v, depth + 1)]
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(value, (type, torch.nn.Module)):
        return [t for v in list(fields.values()) for t in tensors_within(v, depth + 1)]
    return []


def template_constants(template: Template) -> list[Any]:
    """Every non-slot leaf of a template."""
    kind = template[0]
    if kind == "slot" or kind == "input":
        return []
    if kind == "const":
        return [template[1]]
    out: list[Any] = []
    for child in template[2]:
        out.extend(template_constants(child[1] if kind in ("modeloutput", "dataclass", "dict") else child))
    return out


ATOMIC = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device))


def holds_fake(value: Any, depth: int = 0, tensors_only: bool = False) -> bool:
    """Whether a FakeTensor (or, unless `tensors_only`, a symbolic size) is inside `value` (containers and
    plain objects, a few levels deep)."""
    t = type(value)
    if t in ATOMIC:  # (most values a module or config holds: no isinstance walk for them)
        return False
    if t is FakeTensor or isinstance(value, FakeTensor):
        return True
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return not tensors_only
    if depth >= config.scan_depth or isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType)):
        return False
    if t in (list, tuple, set, frozenset) or isinstance(value, (list, tuple)):
        return len(value) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in value)
    if isinstance(value, dict):
        return len(value) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in value.values())
    fields = getattr(value, "__dict__", None)
    if type(fields) is dict and not callable(value):
        return len(fields) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in fields.values())
    return False


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
