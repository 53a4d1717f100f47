"""The errors stampout raises. Each message: what failed (with values), where (the user's file:line), what to do."""

from __future__ import annotations

from .context import note_raised


class StampoutError(RuntimeError):
    """Base class of every error stampout raises on its own account. One made during a capture is noted on the
    capture (trace.frames.swallowed: a program that catches it cannot be captured as it ran)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        note_raised(self)


class CaptureError(StampoutError):
    """The program cannot be captured as written (data-dependent Python, unsupported values)."""


class AutogradCallError(CaptureError):
    """The program differentiates inside itself (`torch.autograd.grad`): `compile` runs the module that does it
    eagerly, its children included (a gradient penalty's double backward cannot go through a compiled graph)."""


class RegionError(StampoutError):
    """A region is used in a way that cannot be made safe (reuse cap, bad `reuse_hash_fn`)."""


class GuardError(StampoutError):
    """A compiled function was called in a way its guards cannot handle."""


class BackendError(StampoutError):
    """A backend failed or is known to be wrong for this graph."""


class ExportError(StampoutError):
    """The program cannot be exported as asked: a dynamic dimension, an input or output an exported program
    cannot carry, or an operation that does not lower to ATen."""


def message(what: str, where: str | None, fix: str) -> str:
    """Format the three lines of a stampout error."""
    lines = [what]
    if where:
        lines.append(f"  at {where}")
    lines.append(f"  fix: {fix}")
    return "\n".join(lines)


def swallowed_error(caught: BaseException) -> CaptureError:
    """The CaptureError for a program that caught `caught` (an error stampout raised during its capture) and went
    on: raised with `caught`'s traceback, so that it names (and piecewise compile finds) the code at fault."""
    text = str(caught).strip()
    lines = text.splitlines()
    where = next((line.strip()[3:] for line in lines[1:] if line.strip().startswith("at ")), None)
    error = CaptureError(message(
        f"the program caught an error stampout raised during the capture and went on without it: "
        f"{lines[0] if lines else type(caught).__name__}", where,
        "let that error propagate (no try/except or contextlib.suppress around code that needs tensor values in "
        "Python): keep the decision in the graph with torch.where or torch.cond, or move it outside the captured "
        "code; stampout.compile runs such code eagerly",
    ))
    return error.with_traceback(caught.__traceback__)
