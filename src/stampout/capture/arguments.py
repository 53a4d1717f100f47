"""Arguments of `capture` and `compile` checked at the call that passes them, and short reprs of the results."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import StampoutError, message
from ..trace.frames import user_location


def check_callable(fn: Any, what: str) -> None:
    """`fn` must be a function, bound method, module or other callable: refused at once otherwise."""
    if not callable(fn):
        raise StampoutError(message(
            f"stampout.{what} needs a function, method or nn.Module, got {type(fn).__name__} ({_short(fn)})",
            user_location(3),
            f"pass the callable itself: stampout.{what}(model, ...) or stampout.{what}(model.forward, ...)",
        ))


def check_call(fn: Any, args: tuple, kwargs: dict, what: str) -> None:
    """`fn(*args, **kwargs)` must bind to `fn`'s signature (a module: its forward's), as the call would."""
    import inspect

    import torch

    fn = getattr(fn, "_orig_mod", fn)  # (a CompiledModule: the module it wraps)
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will say
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(target, "__qualname__", type(fn).__name__)
        raise StampoutError(message(
            f"stampout.{what}({name}, ...): the example inputs do not fit {name}{signature}: {error}",
            user_location(3),
            f"pass the inputs as the call would take them: stampout.{what}(fn, *args, **kwargs)",
        )) from None


def check_arguments(fn: Any, max_entries: Any, fullgraph: Any, disable: Any) -> None:
    check_callable(fn, "compile")
    if type(max_entries) is not int or max_entries < 1:
        raise StampoutError(message(f"max_entries must be a positive int, got {max_entries!r}", user_location(3),
                                    "pass the number of compiled variants to keep, e.g. max_entries=8"))
    for name, value in (("fullgraph", fullgraph), ("disable", disable)):
        if not isinstance(value, bool):
            raise StampoutError(message(f"{name} must be True or False, got {value!r}", user_location(3),
                                        f"pass {name}=True or {name}=False, as with torch.compile"))


def lazy_function(fn: Any) -> str | None:
    """What makes `fn` (a module: its forward) a generator or async function, with its file:line, or None. Calling
    one runs none of its code: it returns a generator or coroutine whose code runs later, when iterated or awaited,
    so a capture that runs the call once cannot record it (its items would be computed on the capture's fakes)."""
    import inspect

    import torch

    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    for test, kind in ((inspect.isgeneratorfunction, "a generator function"),
                       (inspect.isasyncgenfunction, "an async generator function"),
                       (inspect.iscoroutinefunction, "an async function")):
        if test(target):
            code = getattr(inspect.unwrap(getattr(target, "__func__", target)), "__code__", None)
            where = f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}" if code is not None else "<unknown>"
            name = getattr(target, "__qualname__", type(fn).__name__)
            return f"{name} is {kind} (defined at {where}): its code runs when its result is iterated or awaited"
    return None


def eager_because_lazy(fn: Any, fullgraph: bool) -> bool:
    """Whether `fn` is a generator or async function, which compile runs eagerly (saying so once), or refuses with
    fullgraph=True: a capture that calls it once would return a generator over the capture's fake tensors."""
    why = lazy_function(fn)
    if why is not None and fullgraph:
        raise StampoutError(message(f"{why} (fullgraph=True)", user_location(3),
                                    "compile the function the generator calls per item, or pass fullgraph=False"))
    if why is not None:
        logging.getLogger("stampout.guards").warning("stampout.compile runs it eagerly: %s; a capture runs a call "
                                                     "once", why)
    return why is not None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shorten(text: str, limit: int = 400) -> str:
    """`text` cut to `limit` characters, saying how much was left out (log lines stay readable)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def describe(compiled: Any) -> str:
    """A few lines: what is compiled, how, and what happened so far (never the model's tensors)."""
    fn = compiled.fn
    name = getattr(fn, "__qualname__", type(fn).__name__)
    backend = getattr(compiled.backend, "__module__", "")
    backend = backend.rsplit(".", 1)[-1] if backend.startswith("stampout.backends") else _short(compiled.backend)
    flags = [f"backend={backend}", f"dynamic={compiled.dynamic}"]
    flags += [f"{flag}=True" for flag in ("fullgraph", "disable") if getattr(compiled, flag)]
    if compiled.regions:
        flags.append(f"regions={compiled.regions!r}")
    lines = [f"CompiledFunction({name}, {', '.join(flags)})",
             f"  captures={compiled.stats.captures} region traces={compiled.stats.traces} "
             f"entries={len(compiled._entries)}/{compiled.max_entries}"]
    if compiled.last_capture is not None:
        lines.append(f"  last capture: {compiled.last_capture.stats}")
    return "\n".join(lines)
