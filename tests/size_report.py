"""The size report (tinygrad's sz.py): lines per source file, config switches, module-level mutable objects and
private torch names used outside the torch_internals package, measured from the source without importing it, and
compared with the committed baseline (tests/size_baseline.json). Growth fails tests/test_size_report.py.

    python tests/size_report.py            # print the report and what grew
    python tests/size_report.py --update   # accept today's sizes as the baseline (say why in the commit)
"""

from __future__ import annotations

import ast
import json
import os
import sys
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "src", "stampout")
BASELINE = os.path.join(ROOT, "tests", "size_baseline.json")
NEW_FILE_LINES = 400  # a file the baseline does not know may have this many lines
INTERNALS = "torch_internals/"  # the package that is the home of private torch names

# Calls whose result is a mutable container (module-level state when assigned at module level).
_MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakSet",
                            "WeakKeyDictionary", "WeakValueDictionary", "WeakIdKeyDictionary", "local", "register",
                            "bytearray"})
_MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


@dataclass
class Sizes:
    lines: dict[str, int] = field(default_factory=dict)  # per file, relative to src/stampout
    switches: int = 0  # config.SWITCHES entries
    mutable_globals: dict[str, list[str]] = field(default_factory=dict)  # per file: module-level mutable names
    private_torch_names: dict[str, list[str]] = field(default_factory=dict)  # per file outside torch_internals/

    @property
    def mutable_count(self) -> int:
        return sum(map(len, self.mutable_globals.values()))

    @property
    def private_names(self) -> set[str]:
        return {n for names in self.private_torch_names.values() for n in names}


def _files() -> list[tuple[str, str]]:
    out = []
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out.append((os.path.relpath(path, PACKAGE).replace(os.sep, "/"), path))
    return sorted(out)


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def private_torch_names(tree: ast.AST) -> list[str]:
    """The private torch names a module's code names (`torch._C.DisableTorchFunction`, an import from
    `torch._subclasses.fake_tensor`), without the prefixes of longer ones."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            names.update(f"{node.module}.{a.name}" for a in node.names if _private(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("torch.") and _private(a.name))
        elif isinstance(node, ast.Attribute):
            parts, value = [], node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            dotted = "torch." + ".".join(reversed(parts))
            if isinstance(value, ast.Name) and value.id == "torch" and _private(dotted):
                names.add(dotted)
    return sorted(n for n in names if not any(other.startswith(n + ".") for other in names))


def _mutable_value(value: ast.AST | None) -> bool:
    if isinstance(value, _MUTABLE_LITERALS):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in _MUTABLE_CALLS
    return False


def mutable_globals(tree: ast.Module) -> list[str]:
    """Names bound at module level to a mutable container (a dict, list or set, a weak registry, a
    threading.local, a `caches.register(...)` memo): state that outlives a call."""
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if not _mutable_value(getattr(node, "value", None)):
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id != "__all__":
                found.append(target.id)
    return found


def measure() -> Sizes:
    sizes = Sizes()
    for rel, path in _files():
        text = open(path, encoding="utf-8").read()
        tree = ast.parse(text)
        sizes.lines[rel] = len(text.splitlines())
        mutable = mutable_globals(tree)
        if mutable:
            sizes.mutable_globals[rel] = mutable
        if not rel.startswith(INTERNALS):
            names = private_torch_names(tree)
            if names:
                sizes.private_torch_names[rel] = names
        if rel == "config.py":
            sizes.switches = sum(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Switch"
                                 for n in ast.walk(tree))
    return sizes


def load_baseline(path: str = BASELINE) -> Sizes:
    with open(path, encoding="utf-8") as f:
        return Sizes(**json.load(f))


def growth(now: Sizes, base: Sizes) -> list[str]:
    """What grew beyond the baseline, one line each (empty: nothing did)."""
    grew = []
    for rel, lines in now.lines.items():
        limit = base.lines.get(rel, NEW_FILE_LINES)
        if lines > limit:
            known = "baseline" if rel in base.lines else "limit for a new file"
            grew.append(f"src/stampout/{rel}: {lines} lines, {known} {limit}")
    if now.switches > base.switches:
        grew.append(f"config switches: {now.switches}, baseline {base.switches}")
    if now.mutable_count > base.mutable_count:
        new = sorted(f"{rel}:{n}" for rel, names in now.mutable_globals.items() for n in names
                     if n not in base.mutable_globals.get(rel, []))
        grew.append(f"module-level mutable objects: {now.mutable_count}, baseline {base.mutable_count} "
                    f"(new: {', '.join(new)})")
    new = sorted(f"{rel}: {n}" for rel, names in now.private_torch_names.items() for n in names
                 if n not in base.private_torch_names.get(rel, []))
    if new:  # (per file: a module the baseline lists no private name for uses them only via torch_internals)
        grew.append(f"private torch names outside {INTERNALS}: {len(now.private_names)}, baseline "
                    f"{len(base.private_names)} (new: {'; '.join(new)}; add them to torch_internals.NAMES and "
                    "import them from there)")
    return grew


def report(now: Sizes, base: Sizes | None = None) -> str:
    rows = sorted(now.lines.items(), key=lambda kv: -kv[1])
    lines = [f"stampout size report: {len(rows)} files, {sum(now.lines.values())} lines"]
    for rel, n in rows[:15]:
        was = base.lines.get(rel) if base is not None else None
        lines.append(f"  {n:5d}  {rel}" + ("" if was in (None, n) else f"  (baseline {was})"))
    lines.append(f"  ... {len(rows) - 15} more files" if len(rows) > 15 else "")
    lines.append(f"config switches: {now.switches}")
    lines.append(f"module-level mutable objects: {now.mutable_count} in {len(now.mutable_globals)} files")
    used = now.private_torch_names
    lines.append(f"private torch names outside {INTERNALS}: {len(now.private_names)} in {len(used)} files")
    for rel, names in sorted(used.items()):
        lines.append(f"  {rel}: {', '.join(names)}")
    return "\n".join(line for line in lines if line)


def main(argv: list[str]) -> int:
    now = measure()
    if "--update" in argv:
        with open(BASELINE, "w", encoding="utf-8") as f:
            json.dump(asdict(now), f, indent=1, sort_keys=True)
            f.write("\n")
        print(report(now))
        print(f"baseline written: {os.path.relpath(BASELINE, ROOT)}")
        return 0
    base = load_baseline()
    print(report(now, base))
    grew = growth(now, base)
    for line in grew:
        print("GREW:", line)
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
