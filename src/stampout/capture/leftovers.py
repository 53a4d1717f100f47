"""Fakes a capture leaves behind in user state: found on the modules, methods and objects the program reached,
and replaced by the real values an eager call would have stored (or the capture refuses)."""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..backends.runner import as_call_modules
from ..sources import Attr, CallContext, Place
from ..torch_internals import FakeTensor, global_forward_hooks, global_forward_pre_hooks
from ..trace.names import module_tree, root_module
from ..trace.shapes import any_symbolic, concrete
from ..trace.structure import flatten_inputs, holds_fake
from ..trace.tracer import Tracer
from ..watch.world import fake_places
from .effects import Plan
from .result import Capture


def methods_of(modules: list[Any]) -> list[Any]:
    """The functions the classes of `modules` define (their forwards and helpers), each class once."""
    seen: set[type] = set()
    out = []
    for m in modules:
        for klass in type(m).__mro__:
            if klass in seen:
                continue
            seen.add(klass)
            out.extend(v for v in vars(klass).values() if isinstance(v, types.FunctionType))
    return out


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def hooks_of(modules: list[Any]) -> list[Any]:
    """The forward hooks and pre-hooks the program's modules run (theirs and the global ones), as functions: the
    memo containers they close over are user state as much as the forwards' (`acts[name] = out`)."""
    dicts = [global_forward_pre_hooks, global_forward_hooks]
    dicts += [getattr(m, "__dict__", {}).get(name) for m in modules for name in _HOOK_DICTS]
    return [getattr(h, "__func__", h) for d in dicts if d for h in list(d.values())]


def modules_of(fn: Callable) -> list[Any]:
    root = root_module(fn)
    return module_tree(root) if root is not None else []


def uninitialized_module(fn: Callable, modules: list[Any] | None = None) -> str | None:
    """The class of a lazy module of the program not initialized yet (`nn.LazyLinear` before its first call): its
    first call makes its parameters from the input's sizes, which a capture cannot do on fakes. `modules`: the
    program's modules, where listed already (`modules_of(fn)`)."""
    for m in modules_of(fn) if modules is None else modules:
        if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            return type(m).__name__
    return None


_NO_FIELDS: dict = {}
_OPENED = frozenset((dict, list, tuple))  # (what input_held_by looks into: exact classes, as its loop opens them)


def input_held_by(modules: list[Any], leaves: list[Any], labels: list[str]) -> str | None:
    """Where a module of the program holds one of the call's input tensors as a plain attribute, or an item of
    one (`self._last = (x, y)` of an earlier call, then `if self._last[0] is x`): the trace gets a fake for the
    input and the real tensor there, two tensors where eager has one (an identity test takes the other branch).
    Compile runs such a call eagerly; `capture`, which cannot, refuses. Parameters and buffers are not plain
    attributes (a graph reads them by path, and their memory is compared with the inputs')."""
    inputs = {id(t): label for t, label in zip(leaves, labels) if isinstance(t, torch.Tensor)}
    ids = inputs.keys()  # (the inputs are alive, held by `leaves`: an object of one of their ids is that tensor)
    for m in modules if inputs else ():
        fields = getattr(m, "__dict__", _NO_FIELDS)
        # (a pass in C over the module's values and the items of its lists, tuples and dicts; the loop below names
        # the holder, where there is one)
        if ids.isdisjoint(map(id, fields.values())) and all(
                ids.isdisjoint(map(id, dict.values(v) if type(v) is dict else v))
                for v in fields.values() if type(v) in _OPENED):
            continue
        for name, value in list(fields.items()):
            items = value.values() if type(value) is dict else value if type(value) in (list, tuple) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor) and id(item) in inputs:
                    return f"{type(m).__name__}.{name} holds the input {inputs[id(item)]}"
    return None


def left_over_fakes(holders: list[Any], tracer: Tracer, plan: Plan,
                    clean: dict[int, Any] | None = None) -> list[tuple[Any, Any, Place]]:
    """Fake tensors the captured Python stored on objects that outlive it (`self.cache = ...`, `seen.add(t)`):
    (holder, key, Place), each appended to `plan.extra` so the graph computes its real
    value. `clean` (filled where nothing is found): what the holders reach, none of it holding a traced value."""
    found: list[tuple[Any, Any, Place]] = []
    if not holds_fake(holders, whole=True, clean=clean):  # (one walk: no fake and no symbolic size anywhere the
        return found  # holders reach, so no place below holds one; a program that stores none pays one walk)
    seen: set[tuple[int, Any]] = set()
    nodes = tracer.root.nodes
    reals = {id(fake): t for t, fake in tracer._fakes.values() if type(t) is not FakeTensor}
    walked: dict[int, Any] = {}  # (one pass: a config or a bound forward's layer that every holder reaches, walked
    # once; the notes only put real values and concrete sizes where fakes were: see Note: clean objects)

    def note(obj: Any, key: Any, kind: Place, value: Any) -> None:
        real = reals.get(id(value)) if type(value) is FakeTensor else None
        if any_symbolic(value) or real is not None:  # a size of this capture's inputs (or a tuple of them): its
            # value for them; the fake of a real tensor the program read (`self.steps += 1` stores the buffer it
            # wrote in place): that tensor, whose writes are the Capture's calls' to make, as BatchNorm's
            value = concrete(value) if real is None else real
            kind.store(obj, key, value)
            return
        if type(value) is FakeTensor and id(value) in nodes and (id(obj), key) not in seen:
            seen.add((id(obj), key))
            found.append((obj, key, kind))
            plan.extra.append(value)
        elif (type(value) not in _INERT and not isinstance(value, torch.nn.Module)  # (a module: a holder itself)
              and holds_fake(value, tensors_only=True, whole=True, clean=walked)):
            for place in fake_places(value):  # (inside a callable object, a closure, a module it made, ...)
                note(*place)

    walked: set[int] = set()

    def walk(holder: Any, depth: int) -> None:
        if type(holder) is set:  # (a set the call was given: its members have no key but themselves)
            for item in list(holder):
                note(holder, item, Place.MEMBER, item)
            return
        if type(holder) in (list, dict):  # (a container the call was given)
            for key, item in list(holder.items() if type(holder) is dict else enumerate(holder)):
                note(holder, key, Place.ITEM, item)
            return
        fields = getattr(holder, "__dict__", None)
        if type(fields) is not dict or id(holder) in walked:
            return
        walked.add(id(holder))
        for key, value in list(fields.items()):
            t = type(value)
            if t in _INERT or t is OrderedDict and not value.__dict__:  # (a module's flags and hook dicts:
                continue  # nothing a note or a walk would find there)
            if t is list:
                for i, item in enumerate(value):
                    note(value, i, Place.ITEM, item)
            elif t is set:
                for item in list(value):
                    note(value, item, Place.MEMBER, item)
            elif t is dict or key in _REGISTRIES:
                for k, item in list(value.items()):
                    note(value, k, Place.ITEM, item)
            else:
                note(holder, key, Place.ATTR, value)

    for holder in holders:
        walk(holder, 0)
    return found


_REGISTRIES = ("_parameters", "_buffers")



_INERT = frozenset({bool, int, float, str, type(None), frozenset, torch.nn.Parameter, torch.Tensor})


def carried_state(cap: Capture, left: list[tuple[Any, Any, Place]], ctx: CallContext) -> dict[int, torch.Tensor]:
    """Of the fakes left in the program's state (`left`), those replacing a real tensor the graph read from the
    same place (`self.ema = 0.9 * self.ema + 0.1 * m`, `self.h = rnn(x, self.h)`): state carried from call to call,
    by position in `left`, with the tensor read. Like a buffer updated in place, it is the Capture's calls' to
    update: the capture puts the tensor read back, and each call stores the graph's value."""
    places = {(id(obj), key): k for k, (obj, key, _) in enumerate(left)}
    carried: dict[int, torch.Tensor] = {}
    if not places:  # (nothing left: no lifted tensor's place to match; its sources are not resolved)
        return carried
    memo: dict[Any, Any] = {}
    for t, source in cap.lifted:
        if not isinstance(source, Attr) or source.base() is None:
            continue
        try:
            holder = source.base().resolve(ctx, memo)
        except Exception:  # (a path the program's later stores changed: not state read and stored back)
            continue
        for place in (holder, *(getattr(holder, "__dict__", {}).get(r) for r in _REGISTRIES)):
            k = places.get((id(place), source.attr))
            if k is not None:
                carried[k] = t
    return carried


def make_real(cap: Capture, left: list[tuple[Any, Any, Place]], args: tuple, kwargs: dict,
               mutated: list[torch.Tensor], carried: dict[int, torch.Tensor]) -> None:
    """Run the captured graph once on the capture's inputs and store the real tensors where the fakes are. The
    tensors the graph changes in place (`mutated`: an EMA buffer, BatchNorm's statistics) are put back: a capture
    does not touch real tensors (each call of the Capture updates them), except those the program stores: a
    tensor it made (`self.length = torch.tensor(0)`, then `add_`) holds the value eager leaves in it. State carried
    from call to call (`carried`, by position in `left`) gets back the tensor the graph read."""
    leaves = flatten_inputs(args, kwargs)[0]
    inputs = [leaves[i] for i in cap.input_tensor_leaves] + [t for t, _ in cap.lifted]  # as read at capture
    # (the program may since have stored fakes where they were found: `cache.layers[0].keys = cat(...)`)
    with torch.no_grad():
        saved = [(t, t.clone()) for t in mutated]
    outputs = as_call_modules(cap.gm)(*inputs)  # (in the program's grad mode: a stored loss keeps its grad_fn)
    with torch.no_grad():
        stored = {v.untyped_storage().data_ptr() for v in outputs[len(outputs) - len(left):]
                  if isinstance(v, torch.Tensor)}
        for t, value in saved:
            if t.untyped_storage().data_ptr() not in stored:
                t.copy_(value)
    for k, ((obj, key, kind), value) in enumerate(zip(left, outputs[len(outputs) - len(left):])):
        value = carried.get(k, value)
        kind.store(obj, key, value)  # (a set's fake member, the key, gives way to its real value)
