"""The `stampout` command line: `stampout demo`, `stampout bench`, `stampout explain MODULE:ATTR`.

Argument parsing and printing only; the work is done in `stampout.tools.demo`, `stampout.tools.benchmark` and
`stampout.explain`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

EXPLAIN_HELP = """\
Capture a program and print, for every region call, whether it was traced, reused or deduped, and why.

TARGET is MODULE:ATTR (an importable module) or path/to/file.py:ATTR. ATTR (dots allowed) must be
either a callable that takes no arguments and returns the program and its example inputs, or such a
tuple itself:

    (fn_or_module, args)  or  (fn_or_module, args, kwargs)

Example, in mymodel.py:

    def example():
        model = MyModel().eval()
        return model, (torch.randn(2, 16),)

    $ stampout explain mymodel.py:example
"""


class TargetError(ValueError):
    """TARGET could not be loaded or does not follow the (fn_or_module, args[, kwargs]) convention."""


def _load_module(name: str) -> Any:
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise TargetError(f"no such file: {name}")
        module_name = "_stampout_explain_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        sys.path.insert(0, os.path.dirname(path))  # so the file can import its neighbours
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    added = "" not in sys.path and os.getcwd() not in sys.path
    if added:  # `stampout explain mymodel:example` from the model's directory
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise TargetError(
                f"no module named {e.name!r} (run from its directory, or pass path/to/file.py:ATTR)"
            ) from None
        raise
    finally:
        if added:
            sys.path.remove(os.getcwd())


def load_target(target: str) -> tuple[Any, tuple, dict]:
    """Resolve TARGET (see EXPLAIN_HELP) to `(fn_or_module, args, kwargs)`."""
    name, sep, attr = target.rpartition(":")
    if not sep or not name or not attr:
        raise TargetError(f"TARGET must be MODULE:ATTR or path/to/file.py:ATTR, got {target!r}")
    obj = _load_module(name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, tuple):
        import torch

        if isinstance(obj, torch.nn.Module) or (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            raise TargetError(f"{target} is a module, not an example: add a function that builds it and its "
                              "inputs, e.g. `def example(): return model, (x,)`, and pass that instead")
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise TargetError(f"{target} must take no arguments (it is called to build the example), "
                              f"but its signature is {inspect.signature(obj)}") from None
        except ValueError:
            pass  # no signature to check (a builtin): just call it
        obj = obj()
    if not (isinstance(obj, tuple) and len(obj) in (2, 3)):
        raise TargetError(f"{target} must be (or return) a tuple (fn_or_module, args) or (fn_or_module, args, "
                          f"kwargs); got {type(obj).__name__}")
    fn, args, kwargs = (*obj, {}) if len(obj) == 2 else obj
    if not callable(fn):
        raise TargetError(f"the first item of {target} must be a function or module, got {type(fn).__name__}")
    args = args if isinstance(args, (tuple, list)) else (args,)
    if not isinstance(kwargs, dict):
        raise TargetError(f"the kwargs of {target} must be a dict, got {type(kwargs).__name__}")
    return fn, tuple(args), kwargs


def _console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # logs and pipes: keep tables on one line each
        console = Console(width=max(console.width, 140))
    return console


def cmd_demo(args: argparse.Namespace) -> int:
    from .tools import demo

    console = _console()
    try:
        result = demo.run(layers=args.layers, hidden=args.hidden, backend=args.backend,
                          step=lambda msg: console.status(msg + "..."),
                          against_torch_compile=args.against_torch_compile)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    console.print(demo.table(result))
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if not result.ok:
        console.print(f"[red]FAILED:[/red] a result differs from eager by more than {result.tolerance:g}")
        return 1
    console.print("[green]ok[/green]: captured and compiled results match eager")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from .tools import benchmark

    if args.quick:
        args.models, args.depths, args.repeat = ["llama-like"], [1, 2], 1
    if min(args.depths) < 1 or args.repeat < 1:
        print("error: depths and --repeat must be at least 1", file=sys.stderr)
        return 2
    console = _console()
    with console.status("measuring...") as status:
        results = benchmark.run(args.models, args.depths, args.repeat, isolate=not args.in_process,
                                step=lambda msg: status.update(f"measuring {msg}..."))
    console.print(benchmark.table(results))
    console.print(benchmark.per_layer_table(results))
    for line in benchmark.problems(results):
        console.print(f"[red]problem:[/red] {escape(line)}", highlight=False)
    json_path, png_path = benchmark.write(results, args.out)
    console.print(f"wrote {json_path} and {png_path} ({results['total_s']:.1f} s)")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    import stampout

    try:
        fn, fn_args, fn_kwargs = load_target(args.target)
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        report = stampout.explain(fn, *fn_args, **fn_kwargs)
    except stampout.StampoutError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stampout")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from . import __version__

        return __version__


def parser() -> argparse.ArgumentParser:
    from .tools.choices import BENCH_MODELS as MODELS
    from .tools.choices import DEMO_BACKENDS as BACKENDS

    p = argparse.ArgumentParser(prog="stampout", description="Capture PyTorch programs, tracing each repeated "
                                "region once and stamping out the rest.")
    p.add_argument("--version", action="version", version=f"stampout {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="capture and compile a deep Llama-like model; compare with eager",
                       description="Build a Llama-like model with random weights and its decoder layers marked "
                       "as regions; capture it, compile it, and check both against eager. Exits 1 if a result "
                       "differs from eager by more than 1e-4.")
    d.add_argument("--layers", type=int, default=80, help="decoder layers (default: 80)")
    d.add_argument("--hidden", type=int, default=64, help="hidden size, a multiple of 8 (default: 64)")
    d.add_argument("--backend", choices=BACKENDS, default="eager",
                   help="stampout.compile backend (default: eager; inductor compiles for real: slow on few cores)")
    d.add_argument("--against-torch-compile", action="store_true",
                   help="also compile a fresh copy with torch.compile (same backend) and time its first call")
    d.set_defaults(run=cmd_demo)

    b = sub.add_parser("bench", help="capture time vs depth: stampout vs torch.compile (Dynamo) and torch.export",
                       description="Time capture at several depths for stampout (regions, flat), torch.compile's "
                       "Dynamo (flat, nested_compile_region; capture only) and torch.export (strict=False). "
                       "Median of --repeat fresh runs after one warm-up run; each (model, variant) runs in its "
                       "own interpreter unless --in-process. Writes capture_vs_depth.json and .png to --out.")
    b.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    b.add_argument("--depths", nargs="+", type=int, default=[1, 8, 32])
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--out", default=os.path.join("bench", "out"), help="output folder (default: bench/out)")
    b.add_argument("--quick", action="store_true",
                   help="llama-like only, depths 1 2, repeat 1 (overrides those options)")
    b.add_argument("--in-process", action="store_true",
                   help="measure every variant in this process (faster to start, less isolated)")
    b.set_defaults(run=cmd_bench)

    e = sub.add_parser("explain", help="print the region report of a program: stampout explain MODULE:ATTR",
                       description=EXPLAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", metavar="TARGET", help="MODULE:ATTR or path/to/file.py:ATTR")
    e.set_defaults(run=cmd_explain)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]); returns the exit status."""
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
