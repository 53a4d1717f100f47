"""Symbolic sizes: which input dims are dynamic, fakes with symbols, SymInts as FX nodes, and shape guards.

A dynamic capture gives its fake mode a `ShapeEnv`. Input tensors get a symbol for each dynamic dim
(`torch._dynamo.mark_dynamic`, `compile(dynamic=True)`, or a dim a compiled function saw change); Python
arithmetic on sizes builds sympy expressions in those symbols, and every decision the program takes on them
(`if t > 64`, `t % 8 == 0`, a view that needs `t == 2*h`) becomes a guard in the ShapeEnv. Parameters and
everything else stay static; constants such as `eps` are never made symbolic.

In a graph, a size is an expression in the symbols: the outer graph binds each symbol with
`aten.sym_size.int` (or `sym_stride`, `sym_storage_offset`) of the input that defines it, and a region's
subgraph takes the symbols it uses as int inputs ("bound symbols", passed by the caller), so one subgraph
serves every size. An expression we cannot spell in FX is specialized instead (a guard on its value).
"""

from __future__ import annotations

import enum
import operator
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx as fx

from ..errors import StampoutError, message
from ..torch_internals import FakeTensor
from ..torch_internals import sympy_functions as symfn
from .frames import user_location

SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool)  # the symbolic scalar types


def any_symbolic(value: Any) -> bool:
    """Whether an op's arguments hold a symbolic size (inside tuples, lists, dicts and slices)."""
    if isinstance(value, SIZES):
        return True
    t = type(value)
    if t is tuple or t is list or t is torch.Size:
        return any(any_symbolic(v) for v in value)
    if t is dict:
        return any(any_symbolic(v) for v in value.values())
    if t is slice:
        return any_symbolic((value.start, value.stop, value.step))
    return False


def has_symbols(t: torch.Tensor) -> bool:
    return type(t) is FakeTensor and t._has_symbolic_sizes_strides


def concrete(value: Any) -> Any:
    """`value` with each symbolic size replaced by its value for the capture's own inputs (no guard added)."""
    if isinstance(value, SIZES):
        hint = value.node.hint
        return hint if hint is not None else value.node.shape_env.size_hint(value.node.expr)
    t = type(value)
    if t is tuple or t is list or t is torch.Size:
        return t(concrete(v) for v in value)
    if t is dict:
        return {k: concrete(v) for k, v in value.items()}
    return value


# ---- which dims are dynamic ---------------------------------------------------------------------------
def marked_dims(t: torch.Tensor) -> tuple[set[int], set[int]]:
    """Dims marked with torch._dynamo.mark_dynamic / mark_static (dynamic, static)."""
    dynamic = set(getattr(t, "_dynamo_dynamic_indices", ()) or ())
    static = set(getattr(t, "_dynamo_static_indices", ()) or ())
    return dynamic, static


def dynamic_dims(t: torch.Tensor, dynamic: bool | None, automatic: set[int] = frozenset()) -> tuple[int, ...]:
    """The dims of input `t` to capture symbolic: marked ones always; all with dynamic=True; with
    dynamic=None the dims a compiled function saw change (`automatic`). mark_static wins."""
    marked, static = marked_dims(t)
    dims = set(marked) | set(automatic)
    if dynamic is True:
        dims |= set(range(t.dim()))
    return tuple(sorted(d for d in dims - static if 0 <= d < t.dim()))


def symbolic_fake(fake_mode: Any, t: torch.Tensor, name: str, dims: tuple[int, ...], duck: bool = True) -> FakeTensor:
    """A fake of input `t` whose `dims` are symbols (0/1 sizes stay static, as torch.compile does). With
    `duck`, dims of equal size share a symbol (and a guard that they stay equal), as torch.compile's automatic
    dynamic shapes do; without, each dim is its own symbol (export's Dims)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    from ..torch_internals import LocalSource

    kind = DimDynamic.DUCK if duck else DimDynamic.DYNAMIC
    sizes = [kind if i in dims else DimDynamic.STATIC for i in range(t.dim())]
    context = StatelessSymbolicContext(dynamic_sizes=sizes)
    return fake_mode.from_tensor(t, source=LocalSource(name), symbolic_context=context)


# ---- keys ---------------------------------------------------------------------------------------------
def size_key(value: Any) -> Any:
    """An int as itself; a symbolic size as (its ShapeEnv, its expression as the ShapeEnv simplifies it now):
    equal only within one capture. A later guard may simplify it further (see RegionCache.rekey)."""
    if type(value) is int:
        return value
    node = value.node
    expr = node.expr
    if expr.is_number:
        return int(expr) if isinstance(value, torch.SymInt) else expr
    return ("sym", node.shape_env, expr)


def sizes_key(values: Any) -> tuple:
    return tuple(v if type(v) is int else size_key(v) for v in values)


def show_size(value: Any) -> str:
    if isinstance(value, tuple) and value and value[0] == "sym":
        return str(value[2])
    return str(value)


# ---- SymInts in graphs --------------------------------------------------------------------------------
# sympy's operations as FX calls, folded left to right over their arguments
_OPS: dict[type, Callable] = {
    sympy.Add: operator.add,
    sympy.Mul: operator.mul,
    symfn.Max: torch.sym_max,
    symfn.Min: torch.sym_min,
    symfn.FloorDiv: operator.floordiv,
    symfn.CleanDiv: operator.floordiv,
    symfn.PythonMod: operator.mod,
    symfn.Mod: operator.mod,
}
class Part(enum.Enum):
    """Which part of an input a symbol is read from."""

    SIZE = "size"  # a dim of the input's sizes
    STRIDE = "stride"  # a dim of its strides
    OFFSET = "offset"  # its storage offset
    INT = "int"  # the input itself: an int attribute captured as a symbol


class Origin(NamedTuple):
    """Where a symbol is read from: `part` (dim `dim`) of graph input `node`."""

    node: fx.Node
    part: Part
    dim: int


_BINDERS = {Part.SIZE: torch.ops.aten.sym_size.int, Part.STRIDE: torch.ops.aten.sym_stride.int}


class Lifted(NamedTuple):
    """A symbolic input that is not a flat input leaf: the `position`-th lifted tensor (or int) of the capture."""

    position: int


class Symbols:
    """The symbols of one capture: where each is defined (an input placeholder's size, stride or offset)."""

    def __init__(self, shape_env: Any, fake_mode: Any = None) -> None:
        self.shape_env = shape_env
        self.fake_mode = fake_mode
        self.origin: dict[sympy.Symbol, Origin] = {}
        self.values: dict[sympy.Symbol, torch.SymInt] = {}
        # (which input, symbolic fake): a flat input leaf's index, or Lifted(i) for the i-th lifted tensor or int
        self.inputs: list[tuple[int | Lifted, FakeTensor | torch.SymInt]] = []

    def bind_input(self, leaf: int | Lifted, fake: FakeTensor, node: fx.Node) -> None:
        """Remember which symbols input `leaf` (placeholder `node`) defines."""
        self.inputs.append((leaf, fake))
        for part, values in ((Part.SIZE, fake.shape), (Part.STRIDE, fake.stride()),
                             (Part.OFFSET, (fake.storage_offset(),))):
            for dim, value in enumerate(values):
                if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
                    symbol = value.node.expr
                    if symbol not in self.origin:
                        self.origin[symbol] = Origin(node, part, dim)
                        self.values[symbol] = value

    def bind_int(self, key: Lifted, size: torch.SymInt, node: fx.Node) -> None:
        """An int input of the graph (an attribute captured as a symbol) that defines its symbol."""
        self.inputs.append((key, size))
        symbol = size.node.expr
        if symbol not in self.origin:
            self.origin[symbol] = Origin(node, Part.INT, 0)
            self.values[symbol] = size

    def value_of(self, expr: sympy.Expr) -> Any:
        """A SymInt for `expr` (for node metadata)."""
        if expr in self.values:
            return self.values[expr]
        env = self.shape_env
        hint = expr.xreplace(getattr(env, "backed_var_to_val", None) or env.var_to_val)
        return env.create_symintnode(expr, hint=int(hint) if hint.is_number else None)

    def bind_root(self, graph: fx.Graph, symbol: sympy.Symbol) -> fx.Node:
        """The outer graph's node for `symbol`: sym_size / sym_stride / sym_storage_offset of its input."""
        origin = self.origin.get(symbol)
        if origin is None:
            raise StampoutError(message(
                f"the symbolic size {symbol} does not come from an input of the captured call",
                user_location(), "report this as a stampout bug; capture with dynamic=False meanwhile",
            ))
        node, part, dim = origin
        if part is Part.INT:
            return node
        if part is Part.OFFSET:
            new = graph.call_function(torch.ops.aten.sym_storage_offset.default, (node,))
        else:
            new = graph.call_function(_BINDERS[part], (node, dim))
        new.meta["val"] = self.values[symbol]
        return new


class SymbolicValues:
    """Per graph builder: the FX value of each size expression, built from the symbols on demand."""

    def __init__(self, symbols: Symbols, graph: fx.Graph, symbol_node: Callable[[sympy.Symbol], fx.Node]) -> None:
        self.symbols = symbols
        self.graph = graph
        self.symbol_node = symbol_node  # root: bind from an input; subgraph: a bound-symbol placeholder
        self.nodes: dict[sympy.Expr, Any] = {}

    def node_for(self, value: Any) -> Any:
        """An FX argument (node or constant) with `value`'s run-time value."""
        if isinstance(value, torch.SymBool):
            return bool(value)  # a symbolic condition as an op argument: specialized (guarded)
        node = value.node
        expr = node.expr
        if expr.is_number:
            return int(expr) if isinstance(value, torch.SymInt) else float(expr)
        if isinstance(value, torch.SymFloat):
            return float(value)  # specialized: guards the float's value
        if expr not in self.nodes and isinstance(value, torch.SymInt):
            self.symbols.values.setdefault(expr, value)
        out = self._expr(expr)
        if out is None:  # an expression FX cannot spell: specialize it (a guard on its value)
            return int(value)
        return out

    def _expr(self, expr: sympy.Expr) -> Any:
        if expr.is_Integer:
            return int(expr)
        hit = self.nodes.get(expr)
        if hit is not None:
            return hit
        if isinstance(expr, sympy.Symbol):
            out = self.symbol_node(expr)
        elif type(expr) in _OPS:
            out = self._fold(_OPS[type(expr)], expr.args)
        elif isinstance(expr, (sympy.Pow, symfn.PowByNatural)) and expr.args[1].is_Integer and expr.args[1] > 0:
            out = self._fold(operator.pow, (expr.args[0], int(expr.args[1])))
        else:
            return None
        if out is None:
            return None
        if isinstance(out, fx.Node) and "val" not in out.meta:
            out.meta["val"] = self.symbols.value_of(expr)
        self.nodes[expr] = out
        return out


    def _fold(self, fn: Callable, args: tuple) -> Any:
        """`fn` applied left to right over the FX values of `args` (None when one cannot be spelled)."""
        parts = [a if type(a) is int else self._expr(a) for a in args]
        if any(p is None for p in parts):
            return None
        out = parts[0]
        for part in parts[1:]:
            out = self.graph.call_function(fn, (out, part))
        return out


# ---- shape guards -------------------------------------------------------------------------------------
_CALL_INDEX = re.compile(r"\.(size|stride)\(\)\[(\d+)\]")


def guard_clauses(env: Any, placeholders: list[Any]) -> list[str]:
    """What `env` assumes about `placeholders` (tensors, SymInts), one Python expression over `L['t<i>']` (their
    values) per guard."""
    from ..torch_internals import LocalSource

    return env.produce_guards(placeholders, [LocalSource(f"t{i}") for i in range(len(placeholders))],
                              ignore_static=False)


def guards_expression(clauses: list[str]) -> str | None:
    """The guards as one expression; None: nothing. ShapeEnv.produce_guards_expression joins them with " and "
    unparenthesized, so a guard printed as `a == b or c > 0` swallowed all the guards before it (a Hugging Face
    PixArt's `(s // 2) / 8 == 1.5` among them: a symbolic capture ran at sizes it had baked another value for);
    here each guard is parenthesized."""
    return " and ".join(f"({clause})" for clause in clauses) if clauses else None


class ShapeGuards:
    """What a symbolic capture assumed about its dynamic inputs' sizes (ranges, relations, specializations),
    checked on real inputs; built after the backend ran (it may add assumptions of its own)."""

    def __init__(self, symbols: Symbols, names: list[str]) -> None:
        self.symbols = symbols
        self.names = names  # per dynamic input, its label
        self._check: Callable[[list[torch.Tensor]], bool] | None = None
        self._code = ""  # the guards as Python over L['t<i>'] (set by freeze)
        self._clauses: list[str] = []  # each of them
        self._ints: list[int] = []  # the int inputs (attributes captured as symbols), checked by exact type

    @property
    def leaves(self) -> list[int]:
        """The flat input leaves captured symbolic."""
        return [leaf for leaf, _ in self.symbols.inputs if type(leaf) is int]

    @property
    def lifted(self) -> list[int]:
        """The lifted tensors (positions in `Capture.lifted`) captured symbolic."""
        return [key.position for key, _ in self.symbols.inputs if type(key) is Lifted]

    def values(self, leaves: list[Any], lifted: Any) -> list[torch.Tensor]:
        """The call's tensors behind the symbolic inputs, in the guards' order."""
        return [leaves[key] if type(key) is int else lifted[key.position] for key, _ in self.symbols.inputs]

    def freeze(self) -> None:
        """Generate the check from the guards the ShapeEnv holds now."""
        env = self.symbols.shape_env
        fakes = [fake for _, fake in self.symbols.inputs]
        # An int input (an attribute captured as a symbol) must be an int: the ShapeEnv's guards compare values
        # only, and 3.0, True or an int subclass pass them but are another program in eager (`int_tensor * 3.0`
        # is float; `range(3.0)` raises). Dynamo guards such an input's exact type too (TYPE_MATCH).
        ints = [i for i, fake in enumerate(fakes) if isinstance(fake, torch.SymInt)]
        self._ints = ints
        self._clauses = guard_clauses(env, fakes)
        code = guards_expression(self._clauses)
        if code is None:
            if ints:
                self._check = lambda values: all(type(values[i]) is int for i in ints)
            else:
                self._check = lambda values: True
            return
        self._code = code
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        compiled = compile(code, "<stampout shape guards>", "eval")  # (ShapeEnv's evaluator compiles per call)
        names = [f"t{i}" for i in range(len(fakes))]

        def check(values: list[torch.Tensor]) -> bool:
            for i in ints:
                if type(values[i]) is not int:
                    return False
            return eval(compiled, SYMPY_INTERP, {"L": dict(zip(names, values))})  # noqa: S307 - our own code

        self._check = check

    def _frozen(self) -> None:
        if self._check is None:
            self.freeze()

    def check(self, values: list[torch.Tensor]) -> bool:
        self._frozen()
        return bool(self._check(values))

    def describe(self) -> str:
        """The assumptions, with the inputs named as the user knows them (`x.size()[1]`)."""
        self._frozen()
        return self._named(" and ".join(self._clauses)) if self._clauses else "none"

    def why_not(self, values: list[torch.Tensor]) -> str:
        """The first assumption `values` break, and how many more they do."""
        self._frozen()
        for i in self._ints:
            if type(values[i]) is not int:
                return f"{self.names[i]} is an int (it is {values[i]!r}, a {type(values[i]).__name__})"
        clauses = self._clauses
        failed = [c for c in clauses if c and not self._one(c, values)]
        if not failed:
            return "no difference found"
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return self._named(failed[0]) + more

    def summary(self, limit: int = 6) -> str:
        """The first `limit` assumptions and how many more there are (for log lines; `describe` has all)."""
        self._frozen()
        clauses = self._clauses
        if len(clauses) <= limit:
            return self.describe()
        return self._named(" and ".join(clauses[:limit])) + f" and {len(clauses) - limit} more"

    def _one(self, clause: str, values: list[torch.Tensor]) -> bool:
        try:
            return bool(self.symbols.shape_env.evaluate_guards_expression(clause, values))
        except Exception:  # noqa: BLE001 - a clause that does not stand alone: judged with the rest
            return True

    def _named(self, clause: str) -> str:
        for i, name in enumerate(self.names):
            clause = clause.replace(f"L['t{i}']", name)
        return _CALL_INDEX.sub(r".\1(\2)", clause)  # x.size()[1] -> x.size(1), as a user writes it
