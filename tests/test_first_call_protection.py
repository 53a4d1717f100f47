"""Building a compiled entry decides which guards only a watched write can invalidate once per path prefix
(protection.Protection): the verdicts and the watched objects are those of walking every path from the root."""

from __future__ import annotations

import types

import torch
from test_divergent import Stack

import stampout
from stampout.compile.protection import Protection
from stampout.sources import MISSING, Arg, Attr, CallContext, Item
from stampout.tools.demo import build_model
from stampout.trace.structure import flatten_inputs
from stampout.watch.tracking import WriteWatch


def walked_from_root(source, ctx, memo, watch) -> bool:
    """The definition: every step to `source` is an attribute of a watched module reached from the module."""
    path = [source]
    while (parent := path[-1].base()) is not None:
        path.append(parent)
    path.reverse()
    if not (isinstance(path[0], Arg) and path[0].index == 0):
        return False
    if (len(path) > 1 and isinstance(path[1], Attr) and path[1].attr == "__self__"
            and isinstance(path[0].resolve(ctx, memo), types.MethodType)):
        path = path[1:]
    for step in path[:-1]:
        if isinstance(step, Attr) and step.attr == "__dict__":
            continue
        parent = step.base()
        in_dict = isinstance(step, Item) and isinstance(parent, Attr) and parent.attr == "__dict__"
        if parent is not None and not isinstance(step, Attr) and not in_dict:
            return False
        obj = step.resolve(ctx, memo)
        if obj is MISSING or not isinstance(obj, torch.nn.Module) or not watch.watch(obj):
            return False
    return True


def entry_and_context(fn, model, x):
    with torch.no_grad():
        fn(x)
    compiled = getattr(fn, "_compiled", fn)
    (entry,) = compiled._entries
    leaves, _, _ = flatten_inputs((x,), {}, compiled._arg_names)
    return entry, CallContext([compiled.fn, *leaves], compiled._frame_fn, ((x,), {}))


def check_same_verdicts(entry, ctx) -> None:
    sources = [guard.source for guard in entry.capture.program.guards]
    sources += [source for _, source in entry.capture.lifted if source is not None]
    reference_watch, watch = WriteWatch(), WriteWatch()
    try:
        protection = Protection(ctx, {}, watch)
        reference_memo: dict = {}
        verdicts = [protection.path(source) for source in sources]
        expected = [walked_from_root(source, ctx, reference_memo, reference_watch) for source in sources]
        assert verdicts == expected
        assert any(verdicts) and not all(verdicts)
        assert watch._mine == reference_watch._mine  # the same objects watched
    finally:
        watch.release()
        reference_watch.release()


def test_deep_model_verdicts_match_walking_every_path():
    model = build_model(6, 16)
    entry, ctx = entry_and_context(stampout.compile(model, backend="eager"), model, torch.randint(0, 100, (2, 5)))
    check_same_verdicts(entry, ctx)


def test_bound_method_verdicts_match_walking_every_path():
    """A compiled `model.forward`: paths start at the method's `__self__`."""
    torch.manual_seed(0)
    model = Stack(4)
    entry, ctx = entry_and_context(stampout.compile(model.forward, backend="eager"), model, torch.randn(3, 8))
    check_same_verdicts(entry, ctx)
