"""Piecewise compile: what cannot be captured runs eagerly, the rest is still compiled.

When `stampout.compile` cannot capture a module's program (data-dependent Python such as `.item()`, an op
without a fake kernel, a C extension) or cannot guard it, the module's own code runs eagerly and each of its
children is compiled on its own — a `CompiledFunction` per child, sharing the parent's region cache and
backend. A child that cannot be captured either is split the same way when it is first called, so the break
ends up at the innermost module whose own code is at fault (found on the error's traceback), and everything
around it that can be captured is compiled. `fullgraph=True` and `stampout.capture` raise instead.

# Note: calls of the compiled children
The module's code calls its children as `self.layers[i](x)`. Those calls are sent to the children's compiled
functions through `nn.Module.__call__`, replaced while any piecewise call runs (and restored after the last),
with a per-thread table of the modules to redirect: no user-visible attribute changes, and calls of the same
modules from other threads, or from inside a compiled child's own capture, are not redirected.

# Note: the glue of a sharded root
The root of an FSDP2 stack (and a module between it and the sharded blocks, such as a transformers
`LlamaModel`) runs its own code eagerly by design (capture/sharded.py). Its leaf children that are not sharded
themselves — the embedding, the final norm, the LM head, a rotary embedding — are one or two ops each, whose
parameters the root's own FSDP group has all-gathered already: compiled on their own, each was a capture, guards
and a backend compile of a graph no faster than the op, a fifth of a 4-block model's first step. They run
eagerly, as torchtitan leaves them uncompiled (it compiles the sharded blocks only); a child with children of its
own (an unsharded stack, a head of several layers) is still compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..capture.sharded import is_sharded, sharded_below
from ..errors import AutogradCallError
from ..torch_internals import top_saved_tensors_default_hooks
from ..trace.frames import user_location
from ..trace.op_facts import saved_hooks_keep_values

log = logging.getLogger("stampout.breaks")

_ORIGINAL_CALL = nn.Module.__call__
_LOCAL = threading.local()  # .table: {id(module): compiled function} of the piecewise call running here
_INSTALL_LOCK = threading.Lock()
_users = 0
# what `nn.Module.__call__` was when the first running piecewise call replaced it (torch's, or a patch of the user's:
# put back after the last, and the call of every module meanwhile)
_found: list[Any] = [_ORIGINAL_CALL]


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where a compiled function runs code eagerly, and why."""

    module: str  # the module whose own code runs eagerly: its path from the compiled root ("" for the root)
    module_type: str
    reason: str  # the capture error's first line, or why the program cannot be guarded
    where: str | None  # the user's file:line of the failure

    def describe(self) -> str:
        name = f"{self.module} ({self.module_type})" if self.module else self.module_type
        at = f" at {self.where}" if self.where else ""
        return f"graph break in {name}{at}: {self.reason}"


def _redirecting_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    table = getattr(_LOCAL, "table", None)
    found = _found[0]
    if found is not _ORIGINAL_CALL:  # (the user's own `nn.Module.__call__`, installed before: every module call
        return found(self, *args, **kwargs)  # runs through it, as in eager; no child runs compiled meanwhile)
    if table is not None:
        piece = table.get(id(self))
        if piece is not None and not _recomputed_later():
            _LOCAL.table = None  # the child's own capture and calls are its business
            try:
                return piece(*args, **kwargs)
            finally:
                _LOCAL.table = table
    return _ORIGINAL_CALL(self, *args, **kwargs)


def _recomputed_later() -> bool:
    """Whether this call runs under torch's value-keeping saved-tensor hooks (activation checkpointing): its
    backward calls the child again as a plain module (no piece table is set then), so the forward runs it plainly
    too; else the recomputation would differ from what the forward saved (a compiled dropout's mask)."""
    hooks = top_saved_tensors_default_hooks(False)
    return hooks is not None and saved_hooks_keep_values(hooks[0])


@contextlib.contextmanager
def _installed() -> Iterator[None]:
    global _users
    with _INSTALL_LOCK:
        _users += 1
        if _users == 1:
            _found[0] = nn.Module.__call__
            nn.Module.__call__ = _redirecting_call
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            _users -= 1
            if _users == 0 and nn.Module.__call__ is _redirecting_call:  # (else the program set its own: kept)
                nn.Module.__call__ = _found[0]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off during a capture and compile: they allocate many objects, and the
    full collections that triggers scan the whole heap (about 0.1 s of an 8-block FSDP model's 0.6 s first step,
    bench/distributed.py); the cycles they leave are collected at the next collection after. Also across the
    first run of a module run piecewise (`Pieces.run`), which captures its children one after the other: its
    eager code between them counted towards a full collection (0.2 s of a 16-block FSDP model's first step)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def callable_children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The children the module's code calls: its direct children, and the items of its ModuleLists and
    ModuleDicts (containers without a forward of their own), with their paths."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if type(child).forward is nn.Module.forward:
            yield from callable_children(child, f"{path}.")
        else:
            yield path, child


def failing_module(root: nn.Module, error: BaseException) -> tuple[str, nn.Module]:
    """The innermost module of `root`'s tree whose code is on `error`'s traceback, and its path."""
    paths = {id(m): (name, m) for name, m in root.named_modules()}
    found = ("", root)
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            found = paths[id(owner)]
        tb = tb.tb_next
    return found


class Pieces:
    """A module run eagerly, its children's calls sent to their compiled functions."""

    def __init__(self, table: dict[int, Callable], by_path: dict[str, Any], brk: GraphBreak | None,
                 glue: tuple[str, ...] = ()) -> None:
        self.table = table
        self.by_path = by_path  # child path -> its CompiledFunction
        self.graph_break = brk  # the break in this module's own code (None: only a child's is at fault)
        self.glue = glue  # the paths of the children that run eagerly in its code (see the Note: the glue...)
        self.first = True  # (its first run captures and compiles the children as it goes)

    def describe_glue(self) -> str:
        """What `explain` adds to its entry's line for the glue, or "" where there is none."""
        return f"; its unsharded leaf children run eagerly in its code: {', '.join(self.glue)}" if self.glue else ""

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not self.table:
            return fn(*args, **kwargs)
        previous = getattr(_LOCAL, "table", None)
        _LOCAL.table = self.table
        paused, self.first = collection_paused() if self.first else contextlib.nullcontext(), False
        try:
            with _installed(), paused:
                return fn(*args, **kwargs)
        finally:
            _LOCAL.table = previous


def split(compiled: Any, make_child: Callable[[nn.Module, str], Any], reason: str,
          error: BaseException | None) -> Pieces | None:
    """How `compiled` (a CompiledFunction) runs a program it cannot capture (`error`) or guard (`reason`):
    None where it must refuse (fullgraph=True)."""
    if getattr(compiled, "fullgraph", False):
        return None
    root = _root_of(compiled.fn)
    path, culprit = failing_module(root, error) if root is not None and error is not None else ("", root)
    prefix = f"{compiled.path}." if compiled.path else ""
    brk = None
    if culprit is root:  # this module's own code is at fault: the break is here
        name = type(root).__name__ if root is not None else getattr(compiled.fn, "__qualname__", "function")
        where = _location(error) if error is not None else None
        brk = GraphBreak(compiled.path, name, reason, where)
        compiled.breaks.append(brk)
    by_path: dict[str, Any] = {}
    table: dict[int, Callable] = {}
    glue: list[str] = []
    whole = isinstance(error, AutogradCallError) and culprit is root  # (its children are differentiated twice)
    if root is not None and not whole:
        leaves = sharded_glue(root)
        for child_path, child in callable_children(root):
            if id(child) in leaves:
                glue.append(prefix + child_path)
            elif id(child) not in table:
                table[id(child)] = by_path[child_path] = make_child(child, prefix + child_path)
        if glue:
            log.info("%s: its unsharded leaf children %s run eagerly (the glue of a sharded root)",
                     compiled.path or type(root).__name__, ", ".join(glue))
    if brk is not None and error is not None:  # (a program that cannot be guarded is logged by compile)
        log.warning("%s; its own code runs eagerly%s", brk.describe(),
                    f", its {len(table)} children are compiled" if table else "")
    elif brk is None:
        log.info("%s cannot be captured because of %s: it runs eagerly around its %d compiled children",
                 compiled.path or type(root).__name__, prefix + path, len(table))
    return Pieces(table, by_path, brk, tuple(glue))


def sharded_glue(root: nn.Module) -> set[int]:
    """The children of `root` that its eager code calls eagerly (see the Note: the glue of a sharded root): where
    `root` is or holds modules sharded with fully_shard, its leaf children not sharded themselves."""
    if not (is_sharded(root) or sharded_below(root) is not None):
        return set()
    return {id(child) for _, child in callable_children(root)
            if not is_sharded(child) and next(iter(child.children()), None) is None}


def _root_of(fn: Callable) -> nn.Module | None:
    """The module whose own code runs eagerly around its compiled children: `fn` itself, or the sharded module
    whose bound method was compiled (`model.forward = stampout.compile(model.forward)` of an FSDP2 model)."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    sharded = isinstance(owner, nn.Module) and (is_sharded(owner) or sharded_below(owner) is not None)
    return owner if sharded else None


def explain_break(fn: Callable, error: BaseException) -> str:
    """What `explain` says of a program that cannot be captured: where it breaks and what compile does."""
    root = fn if isinstance(fn, nn.Module) else None
    path, culprit = failing_module(root, error) if root is not None else ("", None)
    name = f"{path} ({type(culprit).__name__})" if path else type(culprit or fn).__name__
    brk = GraphBreak(path, type(culprit).__name__ if culprit is not None else name, first_line(error),
                     _location(error))
    children = [p for p, _ in callable_children(culprit)] if culprit is not None else []
    lines = ["stampout capture: no single graph (stampout.capture raises; stampout.compile runs it piecewise)",
             f"  {brk.describe()}",
             f"  stampout.compile runs the own code of {name} eagerly"
             + (f" (and of the modules around it); compiled on their own: {', '.join(children)}" if children else "")]
    return "\n".join(lines)


def _location(error: BaseException) -> str | None:
    """The `at file:line` line of a stampout error message, else the user's frame on its traceback."""
    for line in str(error).splitlines()[1:]:
        line = line.strip()
        if line.startswith("at "):
            return line[3:]
    return user_location()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
