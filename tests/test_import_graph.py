"""The package's import graph has no cycles, counting imports made only for type checking: each module can be
read (and loaded) after what it names, and a protocol lives below both its users and its providers."""

import ast
import pathlib

import stampout

_ROOT = pathlib.Path(stampout.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in _ROOT.rglob("*.py"):
        parts = ("stampout", *path.relative_to(_ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """What `name` imports from the package at module level (also under `if TYPE_CHECKING:`); a function's
    own imports (deferred on purpose) are not followed."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                found.update(submodules)
                if target in modules and len(submodules) < len(node.names):
                    found.add(target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)

    visit(ast.parse(path.read_text()).body)
    return found - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    graph["stampout"] = set()  # (the package's __init__ imports everything it exports: the graph's top)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# `stampout.capture`, `.compile` and `.export` are the public functions; the subpackages of the same names are
# reached only with `from stampout.capture import program` (or relative imports). These forms reach the function:
# `import stampout.capture.program [as p]`, an attribute chain `stampout.capture.program.X`, and
# `monkeypatch.setattr("stampout.capture.program.X", ...)` (pytest resolves its target by attributes).
_SHADOWED = ("stampout.capture.", "stampout.compile.", "stampout.export.")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _shadowed_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith(_SHADOWED) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and _dotted(node).startswith(_SHADOWED):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and _dotted(node.func).endswith("monkeypatch.setattr") and node.args
              and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith(_SHADOWED)):
            lines.append(node.lineno)
    return lines


def test_no_code_reaches_a_subpackage_through_a_public_function():
    repo = _ROOT.parent.parent
    found = []
    for folder in ("src", "tests", "bench"):
        for path in (repo / folder).rglob("*.py"):
            text = path.read_text()
            found += [f"{path.relative_to(repo)}:{n}: {text.splitlines()[n - 1].strip()}"
                      for n in sorted(set(_shadowed_uses(ast.parse(text))))]
    assert not found, "use `from stampout.capture import <module>`:\n" + "\n".join(found)


def test_the_shadowed_forms_are_found():
    code = ("import stampout.compile.function as f\nstampout.export.program.X\n"
            "monkeypatch.setattr('stampout.capture.result.Y', 1)\nfrom stampout.capture import program")
    assert sorted(set(_shadowed_uses(ast.parse(code)))) == [1, 2, 3]


# The package's layers, lowest first: a module imports only from its own layer and those before it, at module
# level, in a function, or under `if TYPE_CHECKING:` alike (README "How it works" names them). context.py (the
# running capture's state, a thread-local) sits below errors.py, whose errors note themselves on it. backends/ sits
# below regions/: it compiles or runs an FX graph and knows nothing of regions, captures or compiled functions
# (regions/stamp, capture/result and compile/function run graphs with backends.runner); report.py, below capture/,
# prints the records of regions and guards (what it shows of compile/ is handed in), for Capture.explain and the
# compiled function's; tools/ (the model zoo, the demo, the benchmark) sits below cli.py, which runs them. sources/
# (where a value lives: `args[0].attn.eps`) sits below trace/: the tracer names lifted tensors by them, watch/ reads
# MISSING, guards/ checks them.
LAYERS = ("torch_internals", "context", "errors", "config", "_logging", "caches", "sources", "trace", "watch",
          "guards", "backends", "regions", "report", "capture", "compile", "export", "api", "tools", "cli")

# What still imports upward, (importer, imported) -> why: none. (An upper layer's code that a lower one runs is
# handed in: the tracer's RegionHooks, the FSDP boundaries' `redirect`.)
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "stampout" and len(parts) > 1 else None


def _all_imports(name: str, is_package: bool, text: str, modules) -> list[tuple[str, int]]:
    """Every package module `name` imports anywhere in its source (module level, functions, TYPE_CHECKING),
    with the line."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def _upward(sources: dict[str, tuple[bool, str]]) -> list[str]:
    """`importer -> imported (line n)` for each import of a later layer; `sources`: module -> (is a package's
    __init__, its text)."""
    out = []
    for name, (is_package, text) in sorted(sources.items()):
        mine = _layer(name)
        for target, line in _all_imports(name, is_package, text, sources):
            theirs = _layer(target)
            if (mine in LAYERS and theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine)
                    and (name, target) not in UPWARD_EXCEPTIONS):
                out.append(f"{name} -> {target} (line {line})")
    return out


def _package_sources() -> dict[str, tuple[bool, str]]:
    return {name: (path.name == "__init__.py", path.read_text()) for name, path in _modules().items()}


def test_every_module_belongs_to_a_layer():
    assert sorted({_layer(name) for name in _modules()} - {None} - set(LAYERS)) == []


def test_layers_import_only_downward():
    found = _upward(_package_sources())
    assert not found, ("an import goes up the layers (tests/test_import_graph.py LAYERS): move the code to the "
                       "layer that owns it or hand the upper layer's hook in at construction:\n  " + "\n  ".join(found))


def test_each_upward_exception_is_still_needed():
    sources = _package_sources()
    used = {(name, target) for name, (is_package, text) in sources.items()
            for target, _ in _all_imports(name, is_package, text, sources)}
    assert sorted(set(UPWARD_EXCEPTIONS) - used) == []


def test_the_layer_checker_finds_a_planted_upward_import():
    sources = {
        "stampout.trace.x": (False, "from ..errors import message\n\ndef f():\n    from ..regions import call\n"),
        "stampout.trace.y": (False, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from stampout.capture.program import P\n"),
        "stampout.regions": (True, "from . import call\nfrom .. import api\n"),
        "stampout.regions.call": (False, "from ..trace import x\n"),
        "stampout.capture.program": (False, ""),
        "stampout.errors": (False, ""),
        "stampout.api": (False, ""),
    }
    assert _upward(sources) == ["stampout.regions -> stampout.api (line 2)",
                                "stampout.trace.x -> stampout.regions.call (line 4)",
                                "stampout.trace.y -> stampout.capture.program (line 3)"]
