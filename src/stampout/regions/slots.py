"""Per-layer indices that do not defeat reuse: `self.layer_idx` used only to pick the layer's own cache entry.

A region trace that reads an `int` attribute of a module gets a `SlotIndex` (an `int` subclass) in its place.
The trace follows what the Python does with it, and proves one of two things:

* it was used only as the index of a list or tuple (`self.layers[layer_idx]`, possibly after being passed as
  an argument to Python functions): then what the trace reads through that item has a per-call source,
  `SlotItem(cache.layers, self.self_attn.layer_idx)`, and the index is not a constant of the trace — one trace
  serves every layer;
* or anything else happened to it (arithmetic, a comparison, hashing, printing, a torch call, a C function,
  a store, a return, a closure): then it is guarded as a constant, as every other int is (fail closed).

The proof follows the value exactly: the bytecode that consumes it where it is read, opcode tracing of the
Python frames that hold it in a local, and `call` events that show which Python function received it. A use
the analysis does not recognise counts as a use of the value.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from typing import Any

import torch

from .. import caches
from ..context import current, listeners
from ..guards.guard import is_constant
from ..sources import MISSING, Item, SlotItem, Source, _item, mro_attr
from ..watch.classpatch import peek
from .slot_index import PLAIN, SlotIndex, SlotState

_LOADS = frozenset({"LOAD_FAST", "LOAD_CONST", "LOAD_DEREF"})
_INSTRUCTIONS: dict[types.CodeType, tuple[list[dis.Instruction], dict[int, int]]] = caches.register(
    {}, "regions.slots instructions")


def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    hit = _INSTRUCTIONS.get(code)
    if hit is None:
        instructions = list(dis.get_instructions(code))
        hit = _INSTRUCTIONS[code] = (instructions, {ins.offset: i for i, ins in enumerate(instructions)})
    return hit


# What may stand between a CALL_FUNCTION_EX's positional tuple and the call: its keyword arguments' dict.
_KEYWORD_PART = frozenset({"LOAD_CONST", "LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_ATTR", "BUILD_MAP",
                           "BUILD_CONST_KEY_MAP", "DICT_MERGE", "DICT_UPDATE"})


def _before_arguments(instructions: list[dis.Instruction], first: int, position: int) -> int | None:
    """The index of the instruction before a call's `position` arguments that precede the slot's expression
    (which starts at `first`), each a simple load (`local`, `local.attr`); None when one is not."""
    k = first - 1
    for _ in range(position):
        while k >= 0 and instructions[k].opname == "LOAD_ATTR":
            k -= 1
        if k < 0 or instructions[k].opname not in _LOADS:
            return None
        k -= 1
    return k


def _global(frame: types.FrameType, name: str) -> Any:
    fn = frame.f_globals.get(name, MISSING)
    return getattr(frame.f_builtins, "get", lambda *_: MISSING)(name, MISSING) if fn is MISSING else fn


class SlotTracker:
    """Follows the slots of one region trace through the Python that runs while it is traced."""

    def __init__(self, frame: Any) -> None:
        self.frame = frame  # the RegionFrame: sources of objects, and the guards
        self._context = current()  # the capture's: counts the slots its traces follow
        self.states: dict[Source, SlotState] = {}
        # id(frame) -> (frame, CALL offset, next instruction's offset, slot): awaiting the Python callee
        self._expected: dict[int, tuple[types.FrameType, int, int, SlotIndex]] = {}
        self._holders: dict[int, types.FrameType] = {}  # frames that hold a slot in a local
        self._traced: list[tuple[types.FrameType, Any, bool]] = []  # (frame, its f_trace, f_trace_opcodes)
        # Lists and tuples read as attributes: id -> [object, reads awaiting a slot subscript {(frame id,
        # BINARY_SUBSCR offset)}, other use seen?]. An item a slot picks may only be reached through the slot.
        self._containers: dict[int, list] = {}
        self._indexed: dict[int, list[SlotState]] = {}  # container id -> slots that indexed it
        self._items: dict[int, SlotState] = {}  # id of an item picked by a slot -> that slot

    # ---- containers: every read must feed a slot subscript --------------------------------------------------
    def container_read(self, value: Any, user: types.FrameType) -> None:
        """The trace read a list or tuple attribute. Unless its bytecode goes straight into
        `container[<local or local.attr...>]`, the container is used some other way."""
        entry = self._containers.setdefault(id(value), [value, set(), False])
        instructions, at = _instructions(user.f_code)
        i = at.get(user.f_lasti)
        ok = i is not None and instructions[i].opname == "LOAD_ATTR" and i + 2 < len(instructions) \
            and instructions[i + 1].opname == "LOAD_FAST"
        j = i + 2 if ok else 0
        while ok and j < len(instructions) and instructions[j].opname == "LOAD_ATTR":
            j += 1
        key = (id(user), instructions[j].offset) if ok and j < len(instructions) else None
        if key is not None and instructions[j].opname == "BINARY_SUBSCR" and key not in entry[1]:
            entry[1].add(key)
        else:  # (a read at a site whose last read no slot consumed: subscripted by something else there)
            entry[2] = True

    def second_name(self, obj: Any) -> None:
        """`obj` was reached by another path too: a container so reached, or an item a slot picked, is not
        reached only through the slot."""
        entry = self._containers.get(id(obj))
        if entry is not None:
            entry[2] = True
        state = self._items.get(id(obj))
        if state is not None:
            state.use("an item reached another way too")

    # ---- where a slot is made: a region reads `obj.name`, an int -----------------------------------------
    def read(self, source: Source, value: int, name: str, user: types.FrameType) -> Any:
        """The value the Python gets for `obj.name`: a SlotIndex when the read site's bytecode hands it to
        something this tracker can follow, else the plain int (guarded as a constant by the caller)."""
        instructions, at = _instructions(user.f_code)
        i = at.get(user.f_lasti)
        if i is None or instructions[i].opname != "LOAD_ATTR" or instructions[i].argval != name:
            return None
        state = self.states.get(source)
        if state is None:
            state = self.states[source] = SlotState(source, value)
            self._count(1)
        first = i - 1  # the start of the expression that pushes the slot: `self.self_attn.layer_idx`
        while first >= 0 and instructions[first].opname == "LOAD_ATTR":
            first -= 1
        first = first if first >= 0 and instructions[first].opname == "LOAD_FAST" else -1
        slot = SlotIndex(value, state)
        if not self._consumer(user, instructions, i, slot, first):
            state.use(f"{instructions[i + 1].opname if i + 1 < len(instructions) else 'the end'} "
                      f"at {user.f_code.co_filename}:{user.f_lineno}")
            return None  # the program gets the plain int
        return slot

    def _consumer(self, frame: types.FrameType, instructions: list[dis.Instruction], i: int,
                  slot: SlotIndex, first: int) -> bool:
        """Whether what consumes the value instruction `i` pushes (the expression pushing it starts at
        `first`, -1 if unknown) treats a SlotIndex exactly as the int: the index of a list or tuple read right
        there, a plain parameter of a Python function, or a local. Registers what follows from it."""
        nxt = instructions[i + 1] if i + 1 < len(instructions) else None
        if nxt is None:
            return False
        if nxt.opname == "BINARY_SUBSCR":
            return first >= 0 and self._index(frame, instructions, first, slot, nxt.offset)
        if nxt.opname == "STORE_FAST":
            if nxt.argval in frame.f_code.co_cellvars:
                return False
            self._hold(frame)
            return True
        return first >= 0 and self._call(frame, instructions, i, first, slot)

    def _call(self, frame: types.FrameType, instructions: list[dis.Instruction], i: int, first: int,
              slot: SlotIndex) -> bool:
        """`obj.method(a, b, <slot>, c, k=d)` with simple argument expressions, where `obj.method` is a Python
        function of `obj`'s class and the slot binds to one of its named positional parameters."""
        after = 0
        j = i + 1
        while j < len(instructions) and instructions[j].opname in _LOADS | {"LOAD_ATTR"}:
            after += instructions[j].opname != "LOAD_ATTR"
            j += 1
        if j < len(instructions) and instructions[j].opname == "BUILD_TUPLE":
            return self._call_ex(frame, instructions, j, first, after, slot)
        keywords = 0
        if j < len(instructions) and instructions[j].opname == "KW_NAMES":
            keywords = len(frame.f_code.co_consts[instructions[j].arg])
            j += 1
        if j + 2 >= len(instructions) or instructions[j].opname != "PRECALL" or instructions[j + 1].opname != "CALL":
            return False
        call = instructions[j + 1]
        position = call.arg - 1 - after  # among the call's arguments
        if after < keywords or position < 0:
            return False
        k = _before_arguments(instructions, first, position)
        if k is None:
            return False
        if k >= 0 and instructions[k].opname == "LOAD_GLOBAL" and instructions[k].arg & 1:  # f(...): NULL, f
            return self._receives(frame, _global(frame, instructions[k].argval), position, call, instructions[j + 2],
                                  slot)
        if k < 1 or instructions[k].opname != "LOAD_METHOD":
            return False
        method = instructions[k].argval
        obj = _spelled(frame, instructions, k - 1)  # `local.attr.method(...)`
        if obj is MISSING or peek(obj, method) is not MISSING:
            return False
        return self._receives(frame, mro_attr(type(obj), method), position + 1, call, instructions[j + 2], slot)

    def _call_ex(self, frame: types.FrameType, instructions: list[dis.Instruction], j: int, first: int, after: int,
                 slot: SlotIndex) -> bool:
        """`f(a, <slot>, b, k=c, **kwargs)` (CALL_FUNCTION_EX: the positionals in one BUILD_TUPLE at `j`, then
        keywords from constants, loads and dict merges) with `f` a global Python function; `after` simple loads
        follow the slot in the tuple."""
        position = instructions[j].arg - 1 - after
        if position < 0:
            return False
        call = j + 1
        while call < len(instructions) and instructions[call].opname in _KEYWORD_PART:
            call += 1
        if call + 1 >= len(instructions) or instructions[call].opname != "CALL_FUNCTION_EX":
            return False
        k = _before_arguments(instructions, first, position)
        if k is None or k < 0 or instructions[k].opname != "LOAD_GLOBAL" or not instructions[k].arg & 1:
            return False
        return self._receives(frame, _global(frame, instructions[k].argval), position, instructions[call],
                              instructions[call + 1], slot)

    def _receives(self, frame: types.FrameType, fn: Any, parameter: int, call: dis.Instruction,
                  after: dis.Instruction, slot: SlotIndex) -> bool:
        """`fn` is a Python function whose named parameter `parameter` the slot binds to: await its frame."""
        if not isinstance(fn, types.FunctionType):
            return False
        code = fn.__code__
        if parameter >= code.co_argcount or code.co_varnames[parameter] in code.co_cellvars:
            return False
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
            return False  # its frame runs later, maybe after the trace
        self._expected[id(frame)] = (frame, call.offset, after.offset, slot)
        self._trace(frame)
        return True

    def _index(self, frame: types.FrameType, instructions: list[dis.Instruction], first: int,
               slot: SlotIndex, subscript: int) -> bool:
        """`container[slot]` with the container spelled `local.attr.attr` just before the slot's expression
        (which starts at `first`): the item's source becomes `SlotItem(container source, slot source)`."""
        state = slot._state
        container = _spelled(frame, instructions, first - 1)
        if container is MISSING:  # `root.groups[gid].buffers[bid]`: the list read just before, for this subscript
            awaiting = [entry[0] for entry in self._containers.values() if (id(frame), subscript) in entry[1]]
            container = awaiting[0] if len(awaiting) == 1 else MISSING
        source = self.frame.sources.get(id(container))
        if type(container) not in (list, tuple) or source is None:
            return False
        entry = self._containers.get(id(container))
        if entry is None or (id(frame), subscript) not in entry[1]:
            return False
        entry[1].discard((id(frame), subscript))
        self._indexed.setdefault(id(container), []).append(state)
        item = _item(container, PLAIN(slot))
        if item is MISSING:
            return True  # (the subscript raises IndexError, as eager does)
        if self.frame.sources.get(id(item)) not in (None, Item(source, PLAIN(slot))):
            state.use("an item reached another way too")
            other = self._items.get(id(item))
            if other is not None:  # (`pool[self.i] + pool[self.j]`, equal here: never one item for both)
                other.use("its item was picked by another index too")
            return True
        if not _renameable(item):
            # A container, a function or a constant is guarded (and its parts named) as soon as the list is read,
            # at the literal index: only what is read through later can be renamed.
            state.use(f"picks a {type(item).__name__}")
            return True
        self._items[id(item)] = state
        picked = SlotItem(source, state.source)
        self.frame.rename(item, picked)
        if isinstance(item, torch.Tensor):  # its metadata, at the layer's own entry (the list read guarded each
            self.frame.adopt(item, picked)  # entry at its literal index; the trace's decisions were on this one)
        return True

    # ---- frames that hold a slot --------------------------------------------------------------------------
    def _trace(self, frame: types.FrameType) -> None:
        if frame.f_trace is not self.on_event:
            self._traced.append((frame, frame.f_trace, frame.f_trace_opcodes))
            frame.f_trace = self.on_event
            frame.f_trace_opcodes = True

    def _hold(self, frame: types.FrameType) -> None:
        self._holders[id(frame)] = frame
        self._trace(frame)

    def on_call(self, frame: types.FrameType) -> Any:
        """A Python frame starts: the callee of an awaited call receives the slot as a local."""
        caller = frame.f_back
        awaited = self._expected.get(id(caller)) if caller is not None else None
        if awaited is None or not awaited[1] <= caller.f_lasti < awaited[2]:
            return None
        del self._expected[id(caller)]
        slot = awaited[3]
        code = frame.f_code
        names = [n for n, v in frame.f_locals.items() if v is slot]
        if not names:
            slot._state.use(f"a call of {code.co_qualname} that does not take it as a plain argument")
            return None
        if any(n in code.co_cellvars for n in names):
            slot._state.use("a closure")
            return None
        self._hold(frame)
        return self.on_event

    def on_event(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "opcode":
            return self.on_event
        awaited = self._expected.get(id(frame))
        if awaited is not None and frame.f_lasti >= awaited[2]:  # the call returned without a Python callee
            del self._expected[id(frame)]
            awaited[3]._state.use("an argument of a C function")
        if id(frame) not in self._holders:
            return self.on_event
        instructions, at = _instructions(frame.f_code)
        i = at.get(frame.f_lasti)
        if i is None:
            return self.on_event
        ins = instructions[i]
        if ins.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"):
            value = frame.f_locals.get(ins.argval)
            if isinstance(value, SlotIndex) and not value._state.closed:
                if ins.opname != "LOAD_FAST" or not self._consumer(frame, instructions, i, value, i):
                    value._state.use(f"{instructions[i + 1].opname} at {frame.f_code.co_filename}:{frame.f_lineno}")
                    frame.f_locals[ins.argval] = PLAIN(value)  # from here on the program holds the plain int
        return self.on_event

    def _count(self, change: int) -> None:
        if self._context is not None:
            self._context.slots_followed += change

    # ---- the end of the trace ---------------------------------------------------------------------------
    def close(self) -> list[SlotState]:
        """Stop following; each slot whose use is not proven is marked used."""
        for *_, slot in self._expected.values():
            slot._state.use("a call that did not return while traced")
        self._expected.clear()
        for frame, trace, opcodes in reversed(self._traced):
            frame.f_trace, frame.f_trace_opcodes = trace, opcodes
        self._traced.clear()
        self._holders.clear()
        for key, states in self._indexed.items():
            _, pending, other = self._containers[key]
            if other or pending:  # the container was also used otherwise (or read by a path not followed)
                for state in states:
                    state.use("a container that was also used another way")
        for state in self.states.values():
            if not state.closed:
                state.closed = True
                self._count(-1)
        return list(self.states.values())




def _spelled(frame: types.FrameType, instructions: list[dis.Instruction], k: int) -> Any:
    """The object `local.attr.attr` that the instructions ending at `k` load (a LOAD_FAST, then LOAD_ATTRs),
    as the objects hold it (our own look: no properties run); MISSING when they spell something else."""
    attrs: list[str] = []
    while k >= 0 and instructions[k].opname == "LOAD_ATTR":
        attrs.append(instructions[k].argval)
        k -= 1
    if k < 0 or instructions[k].opname != "LOAD_FAST":
        return MISSING
    obj = frame.f_locals.get(instructions[k].argval, MISSING)
    with listeners(None, None):
        for attr in reversed(attrs):
            obj = peek(obj, attr) if obj is not MISSING else MISSING
    return obj


def _renameable(item: Any) -> bool:
    """An item a slot may pick: a tensor, a module (not a container of modules) or a plain object — not what
    the list's eager adoption named the parts of (containers), nor functions and constants."""
    if isinstance(item, torch.nn.Module):
        return not isinstance(item, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict))
    return not (isinstance(item, (list, tuple, dict, set, frozenset, type, types.FunctionType,
                                  types.MethodType, types.BuiltinFunctionType, functools.partial))
                or is_constant(item) or item is None)
