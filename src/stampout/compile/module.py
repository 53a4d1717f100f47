"""What `stampout.compile` (api.py) gives a module: an `nn.Module`, as torch.compile's drop-in (a function gets a
`CompiledFunction`).

`CompiledModule` wraps the original module as torch.compile's `OptimizedModule` does (`_orig_mod`, the
original's attributes readable through the wrapper, hooks registered on the wrapper run around the compiled
call) with one difference users ask for: parameters, buffers, submodules and `state_dict` keys are the
original's own (no `_orig_mod.` prefix), so a checkpoint saved from either loads into both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .function import CompiledFunction

# Read through the wrapper from its CompiledFunction; every other missing name is the original module's.
_COMPILED_NAMES = frozenset({"stats", "last_capture", "reset", "fullgraph", "disable", "dynamic", "regions",
                             "backend", "max_entries", "mode", "options", "breaks", "pieces", "guard_code",
                             "explain"})


class CompiledModule(nn.Module):
    """What `stampout.compile(module)` returns: the module, its forward compiled. Attributes read or written
    through it are the original's (`.stats`, `.last_capture`, `.reset()`: its CompiledFunction's).

    Example::

        fast = stampout.compile(model)
        fast(x)                                       # compiled
        fast.state_dict().keys() == model.state_dict().keys()     # True
        fast.eval(); model.training                   # False: train/eval/to act on the original
        fast._orig_mod is model                       # True
    """

    def __init__(self, mod: nn.Module, compiled: CompiledFunction) -> None:
        super().__init__()
        object.__setattr__(self, "_orig_mod", mod)  # not a child: names stay the original's
        object.__setattr__(self, "_compiled", compiled)
        # One registry: nn.Module's own walks over the wrapper (a parent's state_dict/load_state_dict, to(),
        # zero_grad()) see the original's parameters, buffers and children under the original's names.
        # Hooks stay the wrapper's own: they run around the compiled call.
        for registry in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            object.__setattr__(self, registry, getattr(mod, registry))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The user's global module hooks (register_module_forward_hook) run on the original and its children,
        # in the compiled program as in eager; the wrapper is no module of theirs. Its own hooks run around it.
        d = self.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]:
            return super().__call__(*args, **kwargs)
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        if "_compiled" not in state:  # being copied or unpickled
            raise AttributeError(name)
        if name in _COMPILED_NAMES:
            return getattr(state["_compiled"], name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(state["_orig_mod"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        state = self.__dict__
        if "_compiled" not in state or name in state or name.startswith("_"):
            super().__setattr__(name, value)  # the wrapper's own state (nn.Module's, hooks')
        elif name in _COMPILED_NAMES:
            setattr(state["_compiled"], name, value)
        else:
            setattr(state["_orig_mod"], name, value)  # as torch.compile's OptimizedModule

    @property
    def training(self) -> bool:  # type: ignore[override]
        mod = self.__dict__.get("_orig_mod")
        return True if mod is None else mod.training

    @training.setter
    def training(self, mode: bool) -> None:
        mod = self.__dict__.get("_orig_mod")
        if mod is not None:  # nn.Module.__init__ sets it before the original is attached
            mod.training = mode

    def train(self, mode: bool = True) -> CompiledModule:
        self._orig_mod.train(mode)
        return self

    def _apply(self, fn: Callable, recurse: bool = True) -> CompiledModule:
        self._orig_mod._apply(fn, recurse)  # to(), cuda(), cpu(), float(), half(), ...
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> CompiledModule:
        self._orig_mod.apply(fn)
        return self

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._orig_mod.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._orig_mod.named_buffers(*args, **kwargs)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self._orig_mod.named_children()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self._orig_mod.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo: dict) -> CompiledModule:
        """A copy of the original, compiled afresh with the same settings (compiled code is not copied)."""
        compiled = copy.deepcopy(self._compiled, memo)
        return CompiledModule(compiled.fn, compiled)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._orig_mod)) | _COMPILED_NAMES)

    def __repr__(self) -> str:
        inner = "\n".join("  " + line for line in repr(self._orig_mod).splitlines())
        return f"{self._compiled!r}\n{inner}".replace("CompiledFunction(", "CompiledModule(", 1)
