"""Torch calls traced inside a `try` of the user's whose `except` can catch a kernel's error.

A kernel may fail on its values alone (an index out of range, a matrix that is not positive-definite): the fakes of
a capture cannot see it, so the traced program took the `try` body's path, and a compiled graph would raise where
eager runs the `except` branch. Such a call (an op whose kernel checks values, `op_facts.may_fail_on_values`, or a
region call, whose stamped trace runs no Python) is refused (`capture`; `compile` runs the code at fault eagerly, the
module that holds the `try` included, so its Python and its side effects happen once, as in eager).

Which handlers cover a frame's current instruction comes from its code's exception table (CPython 3.11), innermost
first: an `except` clause whose classes (names and attributes, resolved in the frame) catch RuntimeError, IndexError,
ValueError or LinAlgError (`except Exception`, `except LookupError`; not `except NotImplementedError`) catches; so
do a bare `except`, any clause whose expression is not plain names, and a `with contextlib.suppress(...)` block.
`finally` and other `with` blocks do not catch. Only frames of user code between the capture's own frame and the
torch call are read.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import types
from typing import Any

import torch

from .. import caches
from ..context import listeners
from ..errors import CaptureError, message
from .code import is_user_file

# What a kernel's value check raises in Python (TORCH_CHECK, _INDEX, _VALUE, _LINALG); not NotImplementedError (a
# missing kernel) or TypeError: those are not about values, and fakes raise them too.
KERNEL_ERRORS = (RuntimeError, IndexError, ValueError, torch.linalg.LinAlgError)
_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_ATTR", "BUILD_TUPLE"}
_ANY = ("any",)  # a clause that catches whatever it sees (bare `except`, an expression we do not evaluate)

Clause = tuple  # _ANY, or the load instructions of an `except` expression (as (opname, argval) pairs)


class CodeHandlers:
    """The exception table and instructions of one user code object, and the clauses covering each offset."""

    __slots__ = ("code", "table", "instructions", "at", "chains")

    def __init__(self, code: types.CodeType) -> None:
        self.code = code
        self.table = dis._parse_exception_table(code)
        self.instructions: list[dis.Instruction] = []  # (read when an offset is covered: few are)
        self.at: dict[int, int] = {}
        self.chains: dict[int, tuple[tuple[int, Clause], ...]] = {}

    def covering(self, offset: int) -> Any:
        for entry in self.table:
            if entry.start <= offset < entry.end:
                return entry
        return None

    def chain(self, offset: int) -> tuple[tuple[int, Clause], ...]:
        """(line of the `except`, clause) of every handler that may catch an error raised at `offset`."""
        hit = self.chains.get(offset)
        if hit is None:
            hit = self.chains[offset] = self._chain(offset)
        return hit

    def _chain(self, offset: int) -> tuple[tuple[int, Clause], ...]:
        clauses: list[tuple[int, Clause]] = []
        seen: set[int] = set()
        entry = self.covering(offset)
        if entry is not None and not self.instructions:
            self.instructions = list(dis.get_instructions(self.code))
            self.at = {ins.offset: i for i, ins in enumerate(self.instructions)}
        while entry is not None and entry.target not in seen:
            seen.add(entry.target)
            i = self.at.get(entry.target)
            if i is not None and self.instructions[i].opname == "PUSH_EXC_INFO":
                clauses.extend(self._clauses(i + 1))
            entry = self.covering(entry.target)  # (an error the handler lets through: the next one out)
        return tuple(clauses)

    def _clauses(self, i: int) -> list[tuple[int, Clause]]:
        """The clauses of the handler whose body starts at instruction `i` (none: `finally`, `with`)."""
        out: list[tuple[int, Clause]] = []
        ins = self.instructions
        while i < len(ins):
            first = ins[i]
            line = next((x.positions.lineno for x in ins[i:] if x.positions and x.positions.lineno), 0)
            if first.opname == "POP_TOP":  # a bare `except:`
                return [*out, (line, _ANY)]
            if first.opname == "WITH_EXCEPT_START":  # a `with` block: its manager may suppress the error
                made = self._manager_made_by(ins[i - 1].offset)
                return [*out, (line, ("with", made))] if made else out
            if first.opname == "RERAISE":  # no clause matched
                return out
            loads: list[tuple[str, Any]] = []
            j = i
            while j < len(ins) and ins[j].opname in _LOADS:
                loads.append((ins[j].opname, ins[j].argval))
                j += 1
            if j < len(ins) and ins[j].opname == "CHECK_EXC_MATCH" and loads:
                out.append((line, tuple(loads)))
                jump = ins[j + 1] if j + 1 < len(ins) else None
                if jump is None or not jump.opname.startswith("POP_JUMP") or jump.argval not in self.at:
                    return out
                i = self.at[jump.argval]  # the next clause
                continue
            for k in range(i, len(ins)):  # a `finally` body, or an `except` expression we do not follow
                if ins[k].opname == "RERAISE":
                    return out
                if ins[k].opname in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH"):
                    return [*out, (line, _ANY)]
            return out
        return out


    def _manager_made_by(self, handler: int) -> Clause | None:
        """The loads of the callable whose call made the context manager of the `with` block handled at `handler`
        (`contextlib.suppress` in `with contextlib.suppress(RuntimeError):`), or None where it is not plain."""
        starts = [e.start for e in self.table if e.target == handler]
        k = self.at.get(min(starts)) if starts else None
        ins = self.instructions
        if k is None or k < 3 or ins[k - 1].opname != "BEFORE_WITH" or ins[k - 2].opname != "CALL":
            return None
        for j in range(k - 4, -1, -1):  # back from PRECALL to the load that pushed the callable (after a NULL)
            if ins[j].opname not in _LOADS:
                return None
            if ins[j].argrepr.startswith("NULL + "):
                loads = [(ins[j].opname, ins[j].argval)]
                m = j + 1
                while m < k - 3 and ins[m].opname == "LOAD_ATTR":
                    loads.append(("LOAD_ATTR", ins[m].argval))
                    m += 1
                return tuple(loads)
        return None


_CODES: dict[types.CodeType, CodeHandlers | None] = caches.register({}, "caught_kernel_errors codes")
_UNSEEN = object()


def _handlers(code: types.CodeType) -> CodeHandlers | None:
    found = _CODES[code] = (CodeHandlers(code) if code.co_exceptiontable and is_user_file(code.co_filename)
                            else None)
    return found


def _resolve(frame: types.FrameType, loads: Clause) -> Any:
    """The value of an `except` expression of names and attributes, in `frame`."""
    stack: list[Any] = []
    for op, arg in loads:
        if op == "BUILD_TUPLE":
            stack[len(stack) - arg:] = [tuple(stack[len(stack) - arg:])]
        elif op == "LOAD_ATTR":
            stack.append(getattr(stack.pop(), arg))
        else:
            scopes = (frame.f_globals, vars(builtins)) if op == "LOAD_GLOBAL" else (
                frame.f_locals, frame.f_globals, vars(builtins))
            stack.append(next(s[arg] for s in scopes if arg in s))
    return stack[-1]


def _catches(frame: types.FrameType, clause: Clause) -> bool:
    if clause is _ANY:
        return True
    if clause[0] == "with":  # (only contextlib.suppress is known to swallow errors)
        try:
            with listeners(None, None):
                made_by = _resolve(frame, clause[1])
        except Exception:  # noqa: BLE001 - a manager we cannot name is taken not to suppress
            return False
        return isinstance(made_by, type) and issubclass(made_by, contextlib.suppress)
    try:
        with listeners(None, None):
            value = _resolve(frame, clause)
    except Exception:  # noqa: BLE001 - what cannot be resolved is taken to catch (fail closed)
        return True
    for klass in value if isinstance(value, tuple) else (value,):
        if not (isinstance(klass, type) and issubclass(klass, BaseException)):
            return True
        if any(issubclass(raised, klass) for raised in KERNEL_ERRORS):
            return True
    return False


def check_not_caught(frame: types.FrameType | None, root: types.FrameType | None, what: str) -> None:
    """Raise where a user `try` between `frame` and the capture's frame `root` can catch a kernel error of `what`."""
    get = _CODES.get
    while frame is not None and frame is not root:
        handlers = get(frame.f_code, _UNSEEN)
        if handlers is _UNSEEN:
            handlers = _handlers(frame.f_code)
        if handlers is not None:
            for line, clause in handlers.chain(frame.f_lasti):
                if _catches(frame, clause):
                    _refuse(frame, line, what)
        frame = frame.f_back


def _refuse(frame: types.FrameType, line: int, what: str) -> None:
    code = frame.f_code
    raise CaptureError(message(
        f"{what} runs inside a try whose except (at {code.co_filename}:{line}) can catch its error: an error that "
        "depends on tensor values (an index out of range, a matrix that is not positive-definite) is not seen "
        "while tracing, so a compiled graph would raise it instead of running that except",
        f"{code.co_filename}:{frame.f_lineno} in {code.co_name}",
        "stampout.compile runs such code eagerly; check the values with torch.where, or move the try around "
        "the compiled call"))
