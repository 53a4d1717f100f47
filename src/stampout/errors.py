"""The errors stampout raises. Each message: what failed (with values), where (the user's file:line), what to do."""

from __future__ import annotations


class StampoutError(RuntimeError):
    """Base class of every error stampout raises on its own account."""


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
