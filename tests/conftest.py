"""Shared pytest setup.

* Puts the repo root and ``tests/`` on ``sys.path``: ``from stampout.tools.models import ...``,
  ``from tests.helpers import ...`` and ``from helpers import ...`` all work.
* Autouse fixture ``_stampout_clean``: ``stampout.reset()`` before each test; after it, asserts that the
  capture left nothing behind — no TorchFunctionMode or TorchDispatchMode on the stacks, no fake mode,
  grad mode back on, and ``torch.nn.Module`` / ``torch.Tensor`` / ``torch.nn.functional`` not patched.
  Anything leaked is cleaned up before failing, so one bad test does not poison the next.
* ``STAMPOUT_CHECK_WORLD=1``: a capture that leaves a fake tensor in user state raises.
* Hypothesis: a default profile without deadlines and without the function-scoped-fixture health
  check (the autouse fixture runs once per test, not per example; call ``stampout.reset()`` in the
  test body when examples must not share caches). The fuzzers' example counts scale with
  ``STAMPOUT_FUZZ_SCALE`` (tests/fuzzing.py; default 1) for a longer run.
* Several xdist workers: each (and each process a test starts) computes on one thread unless OMP_NUM_THREADS is set.
* Files run longest first (``HEAVY_FIRST``): with ``make test`` (``--dist loadfile --no-loadscope-reorder``) each
  xdist worker takes the next file in collection order, so the long files start at once and the short ones fill
  in at the end, instead of a one-test Inductor file starting last and running alone (xdist's default order is
  by test count). Within a file the order is unchanged.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch._guards import detect_fake_mode

# A fake tensor or symbolic size left in user state after a capture fails the test that made it (world.py).
os.environ.setdefault("STAMPOUT_CHECK_WORLD", "1")

# Several xdist workers (`make test`: one per core): each computes on one thread, and so do the processes its tests
# start, unless OMP_NUM_THREADS says otherwise. Each worker's own pool of one thread per core oversubscribed the
# cores: a parallel op waited for the thread the other worker held, spinning meanwhile.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_TESTS, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "stampout",
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "stampout"))
except ImportError:  # pragma: no cover
    pass


# Files by time, longest first (per-file totals of one `make test` run's junit report, 2 workers; test_fuzz_soundness.py
# at 8 examples per kind). Only the order matters; a file not named here runs after these, in collection order.
HEAVY_FIRST = (
    "test_fuzz_soundness.py", "test_hf_zoo_decoders.py", "test_hf_zoo_diffusers.py", "test_hf_zoo_encoders.py",
    "test_export.py", "test_bench_cli.py", "test_inductor_restart_caches.py", "test_inductor_compile_threads.py",
    "test_dynamic_compile_modes.py", "test_strides.py", "test_redteam4.py", "test_generation.py", "test_fuzz_world.py",
    "test_hf_zoo_training.py", "test_inductor_kernel_batch.py", "test_inductor_headers.py",
    "test_higher_order_backends.py", "test_fsdp_mesh.py", "test_fsdp.py", "test_higher_order.py", "test_backends.py",
)
_RANK = {name: i for i, name in enumerate(HEAVY_FIRST)}


# Red-team files whose tests also run as users run them, with STAMPOUT_CHECK_WORLD off: there a fake left in user
# state is not found by the check (which would turn it into a quiet eager call) and shows as the wrong result it is.
UNCHECKED_TOO = ("test_redteam3.py", "test_redteam_integrate.py", "test_redteam2_grad_mode.py",
                 "test_redteam2_identities.py", "test_redteam2_input_identity.py",
                 "test_redteam2_registered_buffers.py", "test_redteam4.py")


def pytest_generate_tests(metafunc):
    if (metafunc.definition.path.name in UNCHECKED_TOO
            and metafunc.function.__name__ not in getattr(metafunc.module, "UNCHECKED_ONLY", ())):
        metafunc.fixturenames.append("_world_check")
        metafunc.parametrize("_world_check", [True, False], ids=["checked", "unchecked"], indirect=True)


@pytest.fixture
def _world_check(request):
    import stampout

    with stampout.config.patch(check_world=request.param):
        yield


def pytest_collection_modifyitems(config, items):
    """Longest files first (stable: a file's tests keep their order, other files theirs)."""
    items.sort(key=lambda item: _RANK.get(item.path.name, len(HEAVY_FIRST)))


def _watched_namespaces():
    return {
        "torch.nn.Module": torch.nn.Module.__dict__,
        "torch.Tensor": torch.Tensor.__dict__,
        "torch._C.TensorBase": torch._C.TensorBase.__dict__,
        "torch.nn.functional": vars(torch.nn.functional),
    }


def _snapshot():
    return {name: dict(ns) for name, ns in _watched_namespaces().items()}


def _owners():
    return {
        "torch.nn.Module": torch.nn.Module,
        "torch.Tensor": torch.Tensor,
        "torch._C.TensorBase": torch._C.TensorBase,
        "torch.nn.functional": torch.nn.functional,
    }


def _from_stampout(value) -> bool:
    """Whether ``value`` (a patched-in attribute) comes from stampout's code."""
    for v in (
        value,
        getattr(value, "__func__", None),
        getattr(value, "func", None),
        getattr(value, "__wrapped__", None),
        getattr(value, "fget", None),
    ):
        mod = getattr(v, "__module__", None) if v is not None else None
        if isinstance(mod, str) and (mod == "stampout" or mod.startswith("stampout.")):
            return True
    return False


def _patched(before):
    """Names of torch classes/modules that stampout patched and did not restore since ``before``;
    each is put back so the next test starts clean. Changes made by torch itself (Dynamo installs
    permanent ``nn.Module.__init__``/``__setstate__`` hooks on first use) are not flagged."""
    problems = []
    owners = _owners()
    for name, ns in _watched_namespaces().items():
        old = before[name]
        for key in sorted(set(old) | set(ns)):
            if key not in ns:
                if _from_stampout(old[key]):
                    continue  # stampout removing its own leftover is fine
                problems.append(f"{name}.{key} was deleted")
                _restore(owners[name], key, old[key])
            elif key not in old:
                if _from_stampout(ns[key]):
                    problems.append(f"{name}.{key} was added ({ns[key]!r})")
                    _restore(owners[name], key, _MISSING)
            elif ns[key] is not old[key] and _from_stampout(ns[key]):
                problems.append(f"{name}.{key} was replaced by {ns[key]!r}")
                _restore(owners[name], key, old[key])
    return problems


_MISSING = object()


def _restore(owner, key, value):
    try:
        if value is _MISSING:
            delattr(owner, key)
        else:
            setattr(owner, key, value)
    except (AttributeError, TypeError):
        pass


def _function_mode_stack():
    return list(torch.overrides._get_current_function_mode_stack())


def _dispatch_mode_stack():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def _leaks():
    problems = []
    fstack = _function_mode_stack()
    if fstack:
        problems.append(f"TorchFunctionMode stack not empty: {[type(m).__name__ for m in fstack]}")
        while torch._C._len_torch_function_stack() > 0:
            torch._C._pop_torch_function_stack()
    dstack = _dispatch_mode_stack()
    if dstack:
        problems.append(f"TorchDispatchMode stack not empty: {[type(m).__name__ for m in dstack]}")
        while torch._C._len_torch_dispatch_stack() > 0:
            torch._C._pop_torch_dispatch_stack()
    fake = detect_fake_mode()
    if fake is not None:
        problems.append(f"a fake mode is still active: {fake!r}")
    if not torch.is_grad_enabled():
        problems.append("grad mode left disabled")
        torch.set_grad_enabled(True)
    return problems


@pytest.fixture(autouse=True)
def _stampout_clean():
    import stampout

    reset = getattr(stampout, "reset", None)
    if callable(reset):
        reset()
    before = _snapshot()
    leaks_before = _leaks()  # a previous leak is cleaned up here rather than blamed on this test
    del leaks_before
    yield
    problems = _leaks() + _patched(before)
    if problems:
        pytest.fail("capture left state behind:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def llama_config():
    from stampout.tools.models import LlamaConfig

    return LlamaConfig()
