"""One native pass over many tensors: the metadata a guard compares (class, dispatch keys, dtype, device,
requires_grad, layout, sizes, strides, storage offset) and, where asked, the data pointer, read from the
TensorImpl in C++ without a Python call per tensor.

# Note: why not TensorGuards and Python calls
A decode step reads 240 cache tensors per call at 80 layers. TensorGuards checks their metadata in C++, but
the storage offset (which it does not compare) and the data pointer (which decides the aliasing memo,
compile/per_call_aliases.py) were one Python method call per tensor each: about 45 us a call together, growing
with depth. This check reads all of it in one loop, a few ns per tensor.

The extension is compiled on first need with the system's C++ compiler against torch's headers (c10 only: about
one second, in a background thread) into torch's extensions dir (`TORCH_EXTENSIONS_DIR`, `~/.cache/torch_extensions`),
and loaded from there afterwards. Where it cannot be built or loaded,
or the tensor object layout it assumes does not hold (checked on a probe tensor at load), `tensor_facts` answers
None and the callers keep their Python checks. It is stricter than TensorGuards (the thread's dispatch key
modifiers are compared as they were, not applied), never looser: a failure sends the caller to its exact check.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("stampout.guards")

_SOURCE = r"""
#include <Python.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <vector>

namespace {
Py_ssize_t impl_offset = -1;  // where a torch.Tensor object holds its TensorImpl pointer (checked at load)

struct Fact {
  PyTypeObject* type;
  uint64_t keys;
  int dtype, device_type, device_index, layout;
  bool requires_grad;
  int64_t offset;
  const void* data;
  std::vector<int64_t> sizes, strides;
};

struct Facts {
  std::vector<Fact> facts;
  uint64_t included, excluded;
  bool pointers;
};

inline c10::TensorImpl* impl_of(PyObject* o) {
  return *reinterpret_cast<c10::TensorImpl**>(reinterpret_cast<char*>(o) + impl_offset);
}

bool read(PyObject* o, Fact& f, bool pointers) {
  c10::TensorImpl* t = impl_of(o);
  if (t == nullptr || t->layout() != c10::kStrided || t->has_symbolic_sizes_strides() || !t->has_storage()) {
    return false;
  }
  f.type = Py_TYPE(o);
  f.keys = t->key_set().raw_repr();
  f.dtype = static_cast<int>(t->dtype().toScalarType());
  c10::Device device = t->device();
  f.device_type = static_cast<int>(device.type());
  f.device_index = device.index();
  f.layout = static_cast<int>(t->layout());
  f.requires_grad = t->requires_grad();
  auto sizes = t->sizes();
  auto strides = t->strides();
  f.sizes.assign(sizes.begin(), sizes.end());
  f.strides.assign(strides.begin(), strides.end());
  f.offset = t->storage_offset();
  f.data = pointers ? t->storage().data() : nullptr;
  return true;
}

bool same(PyObject* o, const Fact& f, bool pointers) {
  if (Py_TYPE(o) != f.type) return false;
  c10::TensorImpl* t = impl_of(o);
  if (t->key_set().raw_repr() != f.keys || t->storage_offset() != f.offset || !t->has_storage() ||
      static_cast<int>(t->dtype().toScalarType()) != f.dtype || t->requires_grad() != f.requires_grad ||
      t->has_symbolic_sizes_strides() || static_cast<int>(t->layout()) != f.layout) {
    return false;
  }
  c10::Device device = t->device();
  if (static_cast<int>(device.type()) != f.device_type || device.index() != f.device_index) return false;
  auto sizes = t->sizes();
  auto strides = t->strides();
  if (sizes.size() != f.sizes.size() || strides.size() != f.strides.size()) return false;
  for (size_t i = 0; i < f.sizes.size(); ++i) {
    if (sizes[i] != f.sizes[i] || strides[i] != f.strides[i]) return false;
  }
  return !pointers || t->storage().data() == f.data;
}

void drop(PyObject* capsule) { delete static_cast<Facts*>(PyCapsule_GetPointer(capsule, "facts")); }

PyObject* set_offset(PyObject*, PyObject* arg) {
  impl_offset = PyLong_AsSsize_t(arg);
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

// (a tensor) -> its TensorImpl's address as this module reads it (the load-time layout check)
PyObject* impl_address(PyObject*, PyObject* arg) {
  return PyLong_FromVoidPtr(impl_of(arg));
}

// (tuple of tensors, pointers: bool) -> capsule, or None where one of them is not a plain strided tensor
PyObject* record(PyObject*, PyObject* args) {
  PyObject* tensors;
  int pointers;
  if (!PyArg_ParseTuple(args, "O!p", &PyTuple_Type, &tensors, &pointers)) return nullptr;
  auto* facts = new Facts();
  facts->pointers = pointers;
  auto local = c10::impl::tls_local_dispatch_key_set();
  facts->included = local.included_.raw_repr();
  facts->excluded = local.excluded_.raw_repr();
  Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  facts->facts.resize(n);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!read(PyTuple_GET_ITEM(tensors, i), facts->facts[i], pointers)) {
        delete facts;
        Py_RETURN_NONE;
      }
    }
  } catch (...) {
    delete facts;
    Py_RETURN_NONE;
  }
  return PyCapsule_New(facts, "facts", drop);
}

// (capsule, tuple) -> whether each item is as recorded
PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "check(facts, tuple)");
    return nullptr;
  }
  auto* facts = static_cast<Facts*>(PyCapsule_GetPointer(args[0], "facts"));
  if (facts == nullptr) return nullptr;
  PyObject* values = args[1];
  Py_ssize_t n = PyTuple_GET_SIZE(values);
  if (n != static_cast<Py_ssize_t>(facts->facts.size())) Py_RETURN_FALSE;
  auto local = c10::impl::tls_local_dispatch_key_set();
  if (local.included_.raw_repr() != facts->included || local.excluded_.raw_repr() != facts->excluded) {
    Py_RETURN_FALSE;
  }
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!same(PyTuple_GET_ITEM(values, i), facts->facts[i], facts->pointers)) Py_RETURN_FALSE;
    }
  } catch (...) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

struct Dicts {
  PyObject* objects;  // (a tuple, held)
  PyObject* dicts;  // (a tuple, held)
  std::vector<uint64_t> versions;
};

void drop_dicts(PyObject* capsule) {
  auto* d = static_cast<Dicts*>(PyCapsule_GetPointer(capsule, "dicts"));
  Py_XDECREF(d->objects);
  Py_XDECREF(d->dicts);
  delete d;
}

// (objects: tuple) -> capsule: each object's instance dict and its version tag now; None where one has no dict
PyObject* record_dicts(PyObject*, PyObject* objects) {
  if (!PyTuple_Check(objects)) {
    PyErr_SetString(PyExc_TypeError, "record_dicts(tuple)");
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(objects);
  PyObject* dicts = PyTuple_New(n);
  if (dicts == nullptr) return nullptr;
  auto* d = new Dicts{objects, dicts, std::vector<uint64_t>(n)};
  Py_INCREF(objects);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject** slot = _PyObject_GetDictPtr(PyTuple_GET_ITEM(objects, i));
    if (slot == nullptr || *slot == nullptr || !PyDict_CheckExact(*slot)) {
      PyObject* capsule = PyCapsule_New(d, "dicts", drop_dicts);
      Py_XDECREF(capsule);
      Py_RETURN_NONE;
    }
    Py_INCREF(*slot);
    PyTuple_SET_ITEM(dicts, i, *slot);
    d->versions[i] = reinterpret_cast<PyDictObject*>(*slot)->ma_version_tag;
  }
  return PyCapsule_New(d, "dicts", drop_dicts);
}

// (capsule) -> whether each object still has the instance dict it had, unwritten
PyObject* check_dicts(PyObject*, PyObject* capsule) {
  auto* d = static_cast<Dicts*>(PyCapsule_GetPointer(capsule, "dicts"));
  if (d == nullptr) return nullptr;
  Py_ssize_t n = PyTuple_GET_SIZE(d->objects);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject** slot = _PyObject_GetDictPtr(PyTuple_GET_ITEM(d->objects, i));
    PyObject* dict = PyTuple_GET_ITEM(d->dicts, i);
    if (slot == nullptr || *slot != dict ||
        reinterpret_cast<PyDictObject*>(dict)->ma_version_tag != d->versions[i]) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// (values: list or tuple, cls: type) -> whether each value is a `cls` (exactly) whose TensorImpl does not require
// grad (requires_grad() answers as Python's: a grad_fn counts)
PyObject* grad_free(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !(PyList_Check(args[0]) || PyTuple_Check(args[0])) || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "grad_free(list or tuple, type)");
    return nullptr;
  }
  PyObject** items = PySequence_Fast_ITEMS(args[0]);
  Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_TYPE(items[i]) != reinterpret_cast<PyTypeObject*>(args[1])) Py_RETURN_FALSE;
    c10::TensorImpl* t = impl_of(items[i]);
    if (t == nullptr || t->requires_grad()) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"grad_free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(grad_free)), METH_FASTCALL, nullptr},
    {"record_dicts", record_dicts, METH_O, nullptr},
    {"check_dicts", check_dicts, METH_O, nullptr},
    {"set_offset", set_offset, METH_O, nullptr},
    {"impl_address", impl_address, METH_O, nullptr},
    {"record", record, METH_VARARGS, nullptr},
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(check)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};
}  // namespace

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
"""

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_LOCK = threading.Lock()
_LOADED: list[Any] = []  # [module or None] once tried
_BUILDING: list[threading.Thread] = []  # the build started in the background


def _target() -> tuple[str, str, str]:
    """(the module's name, its folder, the path of the built extension)."""
    key = hashlib.sha256(f"{_SOURCE}{torch.__version__}{sys.version}".encode()).hexdigest()[:16]
    name = f"stampout_tensors_{key}"
    # (torch's own place for extensions built at run time: it depends on torch and Python only, not on a cache
    # a cold Inductor run starts empty)
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torch_extensions")
    folder = os.path.join(base, "stampout")
    return name, folder, os.path.join(folder, name + sysconfig.get_config_var("EXT_SUFFIX"))


def _build() -> Any:
    torch_dir = os.path.dirname(torch.__file__)
    name, folder, target = _target()
    if not os.path.exists(target):
        os.makedirs(folder, exist_ok=True)
        source = os.path.join(folder, f"{name}.{os.getpid()}.cpp")
        with open(source, "w", encoding="utf-8") as f:
            f.write(_SOURCE.replace("MODULE_NAME", name))
        partial = f"{target}.{os.getpid()}.tmp"
        lib = os.path.join(torch_dir, "lib")
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
               "-I", os.path.join(torch_dir, "include"), "-I", sysconfig.get_paths()["include"], source, "-o", partial,
               "-L", lib, "-lc10", f"-Wl,-rpath,{lib}"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            os.replace(partial, target)  # (atomic: another process may build it too)
        finally:
            for path in (source, partial):
                if os.path.exists(path):
                    os.remove(path)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = torch.zeros(1)
    for offset in (16, 24, 32):  # (where THPVariable keeps the tensor: after the object header)
        module.set_offset(offset)
        if module.impl_address(probe) == probe._cdata:
            return module
    raise RuntimeError("the tensor object layout is not the one the native check knows")


def _load() -> None:
    try:
        module = _build()
    except Exception as e:  # (no compiler, other headers, another layout: the Python checks stay)
        log.info("no native tensor check (%s: %s); the Python checks run", type(e).__name__, e)
        module = None
    _LOADED.append(module)


def native(wait: bool = True) -> Any:
    """The compiled extension; None where it cannot be had. The first call loads it, or builds it (about a second,
    once per machine and torch version): in this thread, or with `wait=False` in a thread of its own (None until
    it is there: `pending()` says whether it may still come)."""
    if not _LOADED:
        with _LOCK:
            if not _LOADED and not _BUILDING:
                if not wait and not os.path.exists(_target()[2]):  # (built already: loaded at once, in ms)
                    _BUILDING.append(threading.Thread(target=_load, name="stampout native check build", daemon=True))
                    _BUILDING[0].start()
                    return None
                _load()
        if not _LOADED:
            if not wait:
                return None
            _BUILDING[0].join()
    return _LOADED[0]


def pending() -> bool:
    """Whether a build of the extension started with `native(wait=False)` is still running."""
    return not _LOADED and bool(_BUILDING)


def dicts_facts(objects: tuple) -> Callable[[], bool] | None:
    """A check `check()` that each of `objects` still has the instance `__dict__` it has now, unwritten (its
    version tag); None where the native check is not available (yet) or an object has no plain dict."""
    module = native(wait=False) if sys.version_info < (3, 12) else None  # (3.12 reserves bits of the tag)
    if module is None:
        return None
    capsule = module.record_dicts(tuple(objects))
    return None if capsule is None else functools.partial(module.check_dicts, capsule)


def tensor_facts(tensors: tuple, pointers: bool = False) -> Callable[[tuple], bool] | None:
    """A check `check(values)` that `values` (a tuple) are tensors of `tensors`' classes and metadata (and, with
    `pointers`, data pointers), as now; None where the native check cannot vouch for them (a tensor of another
    class or layout, symbolic sizes, no storage) or is not available (yet: while `pending()`, its build runs in
    the background, so that no call waits for it)."""
    if not all(type(t) in _PLAIN for t in tensors):
        return None
    module = native(wait=False)
    if module is None:
        return None
    capsule = module.record(tuple(tensors), pointers)
    return None if capsule is None else functools.partial(module.check, capsule)


def grad_free(values: list | tuple) -> bool:
    """Whether every item of `values` is a plain `torch.Tensor` that does not require grad, in one native pass; False
    where that is not so or the native check is not available (yet): the caller then tests each value."""
    module = _LOADED[0] if _LOADED else native(wait=False)
    return module is not None and module.grad_free(values, torch.Tensor)


def is_native(check: Any) -> bool:
    """Whether `check` is a native pass `tensor_facts` made (not a caller's fallback)."""
    return type(check) is functools.partial and bool(_LOADED) and _LOADED[0] is not None \
        and check.func is _LOADED[0].check


NATIVE_FROM = 16  # tensors from which a check is made native (fewer: TensorGuards and Python calls cost as little)


def tensor_check(tensors: tuple, fallback: Callable[[], Callable[[tuple], bool]], forget: Callable[[], None],
                 pointers: bool = False) -> Callable[[tuple], bool]:
    """A check `check(values)` of `tensors` as now: the native pass (`tensor_facts`) where there are `NATIVE_FROM`
    or more and it vouches for them, else the caller's own, `fallback()`. While the native build still runs, that
    one calls `forget()` on each call once the build is done (the caller drops it: its next check is native)."""
    many = len(tensors) >= NATIVE_FROM
    native = tensor_facts(tensors, pointers) if many else None
    if native is not None:
        return native
    check = fallback()
    if not (many and pending()):
        return check

    def until_built(values: tuple) -> bool:
        if not pending():
            forget()
        return check(values)

    return until_built
