"""A compiled entry's attribute stores (a dynamic KV cache's `layer.keys = cat(...)`, two per layer per decode
step) as one generated function, as the guards are: resolving each store's target through the generic
`Source.resolve` (a memo dict per store, a hashed source per step) cost more than the guard check at 80 layers.

Each store's target is evaluated afresh, in order, by the same step expressions the guards use (nothing is
shared between stores: a store may change what a later target resolves to); the function stops after a store
that moved EPOCH (a write to a watched module: the anchors the targets start from may have moved) and returns
how many it made, so that the caller replays the rest from the root. Only `setattr` of a graph output or a
constant is generated; an entry with any other store keeps the generic replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..capture.effects import Effect, EffectOp, ValueKind
from ..sources import RESOLVE_HELPERS, Absolute, Anchor, Arg, Attr, Closure, Global, Item, SlotItem, Source
from ..torch_internals import grad_free
from ..trace.names import written_as_is
from ..watch.tracking import EPOCH

_STEPS = (Attr, Item, SlotItem)
_ROOTS = (Arg, Anchor, Closure, Global)


def _detached(out: Any) -> Any:
    return out.detach() if out.requires_grad else out  # (AOTAutograd hands back every output as requiring grad)


class _Code:
    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {**RESOLVE_HELPERS, "_detached": _detached, "_EPOCH": EPOCH,
                                          "_grad_free": grad_free}
        self.leaves: dict[str, str] = {}  # an argument's expression -> the local it is read into, once
        self.anchored = False  # (whether an expression made since this was last cleared starts from an anchor)

    def leaf(self, source: Arg) -> str:
        """A call argument, read once at the top: no store can rebind it (`leaves` is the call's own list, which
        the code a store runs cannot reach); what is reached from it is read afresh per store."""
        expr = source.expr("")
        if expr not in self.leaves:
            self.leaves[expr] = f"r{len(self.leaves)}"
        return self.leaves[expr]

    def constant(self, value: Any) -> str:
        name = f"c{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def expr(self, source: Source) -> str | None:
        """A fresh expression for `source`, or None where a step has none a generated function can use."""
        if isinstance(source, Absolute):
            return self.constant(source.obj)
        if isinstance(source, Arg):
            return self.leaf(source)
        if isinstance(source, _ROOTS):
            self.anchored = self.anchored or isinstance(source, Anchor)
            return source.expr("")
        if not isinstance(source, _STEPS):
            return None
        base = self.expr(source.base())
        if base is None:
            return None
        if isinstance(source, SlotItem):
            index = self.expr(source.index)
            return None if index is None else source.expr(base, index)
        if isinstance(source, Item) and type(source.item) not in (int, str):
            return f"_item({base}, {self.constant(source.item)})"
        # Attributes and int or str items read inline (`r0.layers[3]`), not through getattr(.., MISSING) and _item:
        # where the helpers would answer MISSING the store itself would fail; inline, the read raises first.
        if type(source) is Attr and written_as_is(source.attr):
            return f"{base}.{source.attr}"
        if type(source) is Item:
            return f"{base}[{source.item!r}]"
        return source.expr(base)


def compile_replay(effects: list[Effect]) -> Callable[[list, Any, tuple, list, int], int] | None:
    """`replay(leaves, fn, anchors, outputs, epoch)` making `effects` in order, or None when one of them is not
    a `setattr` of a graph output or a constant on a target the generated code can reach."""
    if not effects:
        return None
    code = _Code()
    stores: list[tuple[str, str, bool]] = []  # (the store, the same without grad tests, whether its target starts
    constant: set[int] = set()  # from an anchor); the outputs taken without autograd, and the others
    other: set[int] = set()
    for effect in effects:
        if effect.op is not EffectOp.SETATTR or len(effect.values) != 1 or not isinstance(effect.key, str):
            return None
        code.anchored = False
        target = code.expr(effect.target)
        value = effect.values[0]
        if target is None or value.kind not in (ValueKind.OUT, ValueKind.OUT_CONSTANT, ValueKind.CONST):
            return None
        if value.kind is ValueKind.OUT:
            expr = plain = f"outputs[{int(value.value)}]"
            other.add(int(value.value))
        elif value.kind is ValueKind.OUT_CONSTANT:  # (`_detached`, inline: one call fewer per store)
            expr = f"(_o.detach() if (_o := outputs[{int(value.value)}]).requires_grad else _o)"
            plain = f"outputs[{int(value.value)}]"
            constant.add(int(value.value))
        else:
            expr = plain = code.constant(value.value)
        if written_as_is(effect.key):  # (a store, not a call of setattr)
            stores.append((f"{target}.{effect.key} = {expr}", f"{target}.{effect.key} = {plain}", code.anchored))
        else:
            stores.append((f"setattr({target}, {effect.key!r}, {expr})", f"setattr({target}, {effect.key!r}, {plain})",
                           code.anchored))
    # A store that moved EPOCH stops the function only where a later target starts from an anchor (resolved for
    # the epoch the call began in); a target from the call's arguments, a closure or a global is read afresh per
    # store whatever was written (a dynamic cache's 160 stores: no check between them).
    later_anchored, later = [], False
    for *_, anchored in reversed(stores):
        later_anchored.append(later)
        later = later or anchored
    later_anchored.reverse()

    def body(plain: bool, indent: str) -> list[str]:
        out = []
        for i, ((store, without, _), check) in enumerate(zip(stores, later_anchored)):
            out.append(indent + (without if plain else store))
            if check:
                out.append(f"{indent}if _EPOCH.value != epoch: return {i + 1}")
        return [*out, f"{indent}return {len(effects)}"]

    lines = ["def replay(leaves, fn, anchors, outputs, epoch):",
             *(f"    {local} = {expr}" for expr, local in code.leaves.items())]
    # Outputs taken without autograd are tested for requires_grad (AOTAutograd hands back every output as requiring
    # grad) all at once, natively: where none requires grad the stores take them as they are (160 per-value Python
    # tests cost 6.7 us a decode step at 80 layers); else, or without the native check, each is tested.
    if constant:
        tested = "outputs" if not other and constant == set(range(max(constant) + 1)) else \
            f"({''.join(f'outputs[{i}], ' for i in sorted(constant))})"
        lines += [f"    if _grad_free({tested}):", *body(True, "        ")]
    lines += body(False, "    ")
    source = "\n".join(lines)
    exec(compile(source, "<stampout replay>", "exec"), code.namespace)
    replay = code.namespace["replay"]
    replay.source_code = source  # type: ignore[attr-defined]
    return replay
