"""Review round 5: programs aimed at this round's shortcuts (tests/review5_programs.py), each run through
`stampout.compile` and compared with eager over ten calls with the changes a user makes between them: outputs,
gradients, the caller's objects and what the world holds after."""

from __future__ import annotations

import pytest
import stampout
from redteam_battery import calls
from review5_programs import LONG, PROGRAMS
from test_redteam3 import _same

UNCHECKED_ONLY = ("test_a_program_matches_eager",)

_THROUGH_AOT = {"custom_function_backward_reads_closure", "anomaly_mode_and_default_dtype_in_forward", "custom_function_inside_regions", "forward_registers_buffer_and_parameter",
                "alternating_shapes_dtypes_grad", "tensor_attribute_flag_flipped"}
_CASES = [(name, "eager") for name in PROGRAMS] + [(name, "aot_eager") for name in PROGRAMS if name in _THROUGH_AOT]


@pytest.mark.parametrize(("name", "backend"), _CASES)
def test_a_program_matches_eager(name, backend):
    with stampout.config.patch(check_world=False):
        expected = calls(PROGRAMS, name, None, n=LONG.get(name, 10))
        got = calls(PROGRAMS, name, backend, n=LONG.get(name, 10))
    for i, (g, e) in enumerate(zip(got, expected)):
        _same(g, e, f"call {i}")


@pytest.mark.inductor
def test_a_background_lowering_draws_eagers_random_numbers():
    """A new length's symbolic recapture lowers on the background thread; its random ops must still run torch's own
    kernels (`fallback_random`, patched around the caller's compile only): the noise and the generator's state after
    each call are eager's."""
    import torch
    from stampout.backends import background

    def noisy(x):
        return (x * 2 + torch.randn_like(x)).sum(-1)

    f = stampout.compile(noisy, backend="inductor")
    for n in (8, 13, 16):
        if n == 16:
            background.wait_all(300)
        x = torch.ones(2, n)
        torch.manual_seed(n)
        with torch.no_grad():
            got, after = f(x), torch.rand(3)
        torch.manual_seed(n)
        expected, expected_after = noisy(x), torch.rand(3)
        torch.testing.assert_close(got, expected, msg=lambda m: f"length {n}: {m}")
        torch.testing.assert_close(after, expected_after)
    assert background.LOWERING_STATS["lowered"] >= 1


def test_a_class_the_attribute_watch_patches_after_its_names_were_noted_is_no_change():
    """A subclass of nn.Linear adopted first notes nn.Linear's `__getattr__` as absent (found on nn.Module); a plain
    nn.Linear adopted next makes the capture's attribute watch patch nn.Linear: not a change the program made (was:
    the program ran eagerly, as in the Hugging Face Falcon decoder)."""
    import torch
    from torch import nn

    class MyLinear(nn.Linear):
        pass

    torch.manual_seed(0)
    m = nn.Sequential(MyLinear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    f = stampout.compile(m, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(x), m(x))
    assert f.breaks == [] and f.stats.captures == 1


def test_shape_guards_with_an_or_guard_keep_every_guard():
    """ShapeEnv.produce_guards_expression joins guards with ' and ' unparenthesized: a guard printed as `a or b`
    swallowed every guard before it, so a symbolic capture admitted sizes it had baked another value for (a Hugging
    Face PixArt at 32 after capturing at 24: `(s // 2) / 8 == 1.5`). trace/shapes.guards_expression parenthesizes."""
    import torch
    from stampout.torch_internals import FakeTensorMode
    from stampout.trace.shapes import guard_clauses, guards_expression
    from torch.fx.experimental.symbolic_shapes import (SYMPY_INTERP, DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext, sym_or)

    env = ShapeEnv()
    fake = FakeTensorMode(shape_env=env).from_tensor(
        torch.ones(24), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    s = fake.shape[0]
    assert bool(s // 2 != 8)
    assert bool(sym_or(s == 100, s > 3))
    code = guards_expression(guard_clauses(env, [fake]))

    def admits(n):
        return eval(code, SYMPY_INTERP, {"L": {"t0": torch.ones(n)}})  # noqa: S307 - guard code

    assert admits(24) and admits(40)
    assert not admits(16)  # (s // 2 == 8: the first guard fails)
