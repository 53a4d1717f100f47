"""A torch process-wide setting changed inside forward (`torch.set_num_threads`, matmul precision, the
torch.backends flags, ...) outlives the call, and a graph neither keeps nor repeats it: a compiled program that
sets one runs eagerly, so every call leaves the setting as eager does. Ops and the state a graph keeps (grad
mode, autocast) are unaffected: such a program is still compiled."""

from __future__ import annotations

import pytest
import torch

import stampout

# (name, setter called in forward, read the setting, set it back as the user would)
SETTINGS = [
    ("set_num_threads", lambda: torch.set_num_threads(1), torch.get_num_threads,
     lambda v: torch.set_num_threads(v)),
    ("set_float32_matmul_precision", lambda: torch.set_float32_matmul_precision("medium"),
     torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("set_flush_denormal", lambda: torch.set_flush_denormal(True), lambda: torch.tensor(1e-40).item() == 0.0,
     lambda v: torch.set_flush_denormal(v)),
    ("backends.mkldnn.enabled", lambda: setattr(torch.backends.mkldnn, "enabled", False),
     lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    ("backends.cudnn.benchmark", lambda: setattr(torch.backends.cudnn, "benchmark", True),
     lambda: torch.backends.cudnn.benchmark, lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    ("use_deterministic_algorithms", lambda: torch.use_deterministic_algorithms(True),
     torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    # (settings torch keeps in Python: no C call sets them)
    ("backends.opt_einsum.enabled", lambda: setattr(torch.backends.opt_einsum, "enabled", False),
     lambda: torch.backends.opt_einsum.enabled, lambda v: setattr(torch.backends.opt_einsum, "enabled", v)),
    ("backends.mha.set_fastpath_enabled", lambda: torch.backends.mha.set_fastpath_enabled(False),
     torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled),
    ("set_printoptions", lambda: torch.set_printoptions(precision=2), lambda: torch._tensor_str.PRINT_OPTS.precision,
     lambda v: torch.set_printoptions(precision=v)),
]
SETTINGS = [pytest.param(*s, id=s[0]) if type(s) is tuple else s for s in SETTINGS]

# Each setting's value before every call: another than the one forward sets.
START = {"set_num_threads": 2, "set_float32_matmul_precision": "highest", "set_flush_denormal": False,
         "backends.mkldnn.enabled": True, "backends.cudnn.benchmark": False, "use_deterministic_algorithms": False,
         "backends.opt_einsum.enabled": True, "backends.mha.set_fastpath_enabled": True, "set_printoptions": 4}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name, setter, read, put", SETTINGS)
def test_a_setting_changed_in_forward_is_changed_on_every_call(backend, name, setter, read, put):
    def program(x):
        setter()
        return x + 1

    original = read()
    start = START[name]  # (not what forward sets: a compiled call that dropped the setter would read it)

    def calls(fn):
        seen = []
        for _ in range(3):
            put(start)  # (the user puts it back between calls)
            out = fn(torch.ones(2))
            seen.append(read())
        return out, seen

    try:
        expected = calls(program)
        stampout.reset()
        got = calls(stampout.compile(program, backend=backend))
    finally:
        put(original)
    assert expected[1] != [start] * 3, "the setter must change the setting for the test to mean anything"
    torch.testing.assert_close(got[0], expected[0])
    assert got[1] == expected[1]


class Counted:
    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.runs += 1
            return gm(*args)
        return run


def _ops_and_kept_state(x):
    with torch.no_grad():
        y = torch.add(x, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = torch.mm(y, y.t())
    with torch.set_grad_enabled(True):
        return z.float() * torch.get_num_threads()


def test_ops_grad_mode_and_autocast_are_still_compiled():
    stampout.reset()
    counted = Counted()
    compiled = stampout.compile(_ops_and_kept_state, backend=counted)
    x = torch.ones(2, 2)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), _ops_and_kept_state(x))
    assert counted.runs == 2
    assert compiled.stats.captures == 1


def test_a_region_that_sets_threads_is_not_reused():
    stampout.reset()
    original = torch.get_num_threads()

    @stampout.region
    def block(x):
        torch.set_num_threads(original)
        return x * 2

    def program(x):
        return block(block(x))

    cap = stampout.capture(program, torch.ones(2))
    assert cap.stats.reuses == 0
    torch.testing.assert_close(cap(torch.ones(2)), program(torch.ones(2)))


def test_a_region_that_sets_a_python_held_torch_setting_is_not_reused():
    stampout.reset()
    original = torch.backends.opt_einsum.enabled

    @stampout.region
    def block(x):
        setattr(torch.backends.opt_einsum, "enabled", False)  # noqa: B010 (no STORE_ATTR: seen by its effect)
        return x * 2

    def program(x):
        torch.backends.opt_einsum.enabled = True
        y = block(x)
        torch.backends.opt_einsum.enabled = True
        return block(y)

    try:
        cap = stampout.capture(program, torch.ones(2))
        assert cap.stats.reuses == 0 and cap.stats.traces + cap.stats.dedups == 2  # (each call traced)
        torch.testing.assert_close(cap(torch.ones(2)), program(torch.ones(2)))
    finally:
        torch.backends.opt_einsum.enabled = original
