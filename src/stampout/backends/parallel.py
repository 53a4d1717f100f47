"""Distinct regions compiled in parallel: worker processes lower them into Inductor's caches.

Lowering (AOTAutograd, Inductor's scheduling and code generation) is Python and holds the GIL, so threads cannot
compile two regions at once; processes can. When one compile has several distinct regions to compile apart (an
encoder and a decoder block, a DiT's double and single blocks, a last block that differs), the calling process
compiles the first and hands the others to worker processes. A worker receives the region's subgraph and example
inputs (torch's GraphPickler: nodes with their fake values), the settings the compile depends on (Inductor's and
AOTAutograd's config, stampout's switches, grad mode, intra-op threads), compiles it exactly as the caller would
(inductor.compile_region_graph; the worker's side is region_worker.py), and so fills the FX graph and AOTAutograd
caches of the shared `TORCHINDUCTOR_CACHE_DIR` with it, C++ modules included. The caller then compiles that region itself, as always,
and finds it there: a cache load instead of a compile. What serves is what a restart on that cache directory would
load, so a worker decides nothing about results; a worker that fails or disagrees (a cache miss) costs time only.

Workers start when a compile has two or more distinct regions of `config.parallel_min_nodes` compute nodes or more
(tiny graphs compile faster than a Python interpreter imports torch): `config.parallel_regions` of them at most
(-1: one per CPU this process may use beyond two, at most AUTO_MOST). The default is 0, none: measured below, a
worker's start (importing torch and Inductor, Inductor's once-per-process checks) outlasts a region's compile. A worker announces itself once its imports are done; until a
worker takes a region, the caller takes it back when it gets there (`claim`), so a slow start costs nothing but
the worker's own CPU. A region this cache directory already holds (compiled here before: the store's "regions")
is not handed out, so a restart starts no worker; one that does anyway (a cache cleared and refilled by torch alone)
takes them all back, and the workers still importing are stopped when its compile ends (`release`). Idle workers exit after IDLE_S seconds, and with this
process. Symbolic graphs (a new
size's recapture: background.py) and tensor subclasses stay in the calling process, and nothing goes to a worker
while the FX graph or AOTAutograd cache is off (a worker's compile could not reach this process).

Measured on this project's shared 2-CPU machine (load 8-10, SD3 transformer with 4 blocks, two distinct regions,
one worker forced, bench/first_call.py --base-src, 2 repeats): the worker was never ready before this process
reached the second region (9-32 s to import under that load), so both were compiled here, and the cold first call
took 47-56 s against 30-35 s without workers, 20.5 against 14.7 CPU seconds. On the same machine quiet (load < 2),
the same compile takes 7.3-7.7 s without a worker (15.4-16.1 CPU s) and 8.6-11.4 s with one (18.6-20.0 CPU s): the
first region is compiled in ~3 s, before the worker has imported torch (~4 s), so it is overtaken there too, and
more CPUs would not change that for two distinct regions. Workers can pay where this process spends longer before
the regions it hands out (three or more distinct regions, or larger ones): opt in with parallel_regions.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
import torch.fx as fx

from .. import config
from . import store

log = logging.getLogger("stampout.backends")

IDLE_S = 120.0  # an idle worker exits after this many seconds
AUTO_MOST = 4  # workers at most, by default
_NAMESPACE = "regions"  # store namespace: region compiles this cache directory holds
STATS = {"workers_started": 0, "submitted": 0, "compiled_by_worker": 0, "taken_back": 0, "worker_failed": 0}


@dataclass(eq=False)
class Job:
    """One region for a worker: its payload, and what became of it."""

    name: str
    payload: bytes
    state: str = "queued"  # queued -> running -> done | failed; queued -> taken back
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)


_lock = threading.Lock()
_queue: queue.Queue[Job] = queue.Queue()
_jobs: dict[tuple, Job] = {}  # (id(subgraph), key) -> its job, until claimed
_workers: list[_Worker] = []


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def worker_count(jobs: int) -> int:
    """How many workers `jobs` regions get: `config.parallel_regions` at most, or with -1 one per CPU beyond two
    (this process lowers on one, its C++ compiles run on the other: on two CPUs a worker only competes with them)."""
    most = config.parallel_regions if config.parallel_regions >= 0 else min(AUTO_MOST, cpus() - 2)
    return max(0, min(jobs, most))


# ---------------------------------------------------------------------------------------------- the caller


def fingerprint(subgraph: fx.GraphModule, vals: list[Any], grad_enabled: bool) -> str:
    """A region compile's name in the store: its code, operands, grad mode, settings and torch's version."""
    from .split import metadata

    return hashlib.sha256(repr((subgraph.code, [metadata(v) for v in vals], grad_enabled, sorted(config.values().items()),
                                torch.__version__)).encode()).hexdigest()


def remember(fingerprint: str) -> None:
    """This cache directory holds the region compile `fingerprint` (a restart loads it: no worker for it)."""
    store.update(_NAMESPACE, {fingerprint: 1})


def submit(regions: list[tuple[tuple, str, fx.GraphModule, list[Any], bool]]) -> int:
    """Hand `regions` ((key, name, subgraph, example values, grad mode) each, in the order the caller will reach them) to
    workers, the last first, but those this cache directory already holds (`remember`); returns how many were handed.
    The caller must `claim` each key before compiling it."""
    from ..torch_internals import functorch_config, inductor_config

    if not (inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache) \
            or inductor_config.force_disable_caches:
        return 0  # (nothing a worker compiles could reach this process)
    payloads = []
    cached = store.load(_NAMESPACE)
    for key, name, subgraph, vals, grad_enabled in regions:
        if fingerprint(subgraph, vals, grad_enabled) in cached:
            continue
        payload = _payload(name, subgraph, vals, grad_enabled)
        if payload is not None:
            payloads.append((key, Job(name, payload)))
    if worker_count(len(payloads)) == 0:
        return 0
    with _lock:
        for key, job in reversed(payloads):
            _jobs[key] = job
            _queue.put(job)
    STATS["submitted"] += len(payloads)
    _start()
    return len(payloads)


def _start() -> None:
    with _lock:
        waiting = sum(1 for job in _jobs.values() if job.state == "queued")
        _workers[:] = [w for w in _workers if w.alive()]
        count = worker_count(waiting)
        if count <= len(_workers):
            return
        while len(_workers) < count:
            _workers.append(_Worker())
    log.info("inductor: %d distinct regions handed to %d worker process(es)", waiting, count)


def claim(key: tuple) -> bool:
    """Before the caller compiles the region `key`: True when a worker compiled it into the caches (waited for
    if it is compiling it now), False when no worker did (one not yet taken is taken back)."""
    with _lock:
        job = _jobs.pop(key, None)
        if job is None:
            return False
        if job.state == "queued":
            job.state = "taken back"
            STATS["taken_back"] += 1
            return False
    job.finished.wait()
    if job.state != "done":
        log.warning("inductor: a worker process failed to compile region %s (%s); compiling it here", job.name,
                    (job.error or "").strip().splitlines()[-1:] or "")
        STATS["worker_failed"] += 1
        return False
    STATS["compiled_by_worker"] += 1
    log.debug("inductor: region %s compiled by a worker process", job.name)
    return True


def release(keys: list[tuple]) -> None:
    """After the compile that submitted `keys`: forget those not claimed (it failed), so that a worker not yet on
    them skips them, and stop the workers still importing (a restart that loaded every region from the caches
    took them all back; the ready ones stay for the next compile, IDLE_S seconds)."""
    with _lock:
        for key in keys:
            job = _jobs.pop(key, None)
            if job is not None and job.state == "queued":
                job.state = "taken back"
        starting = [w for w in _workers if not w.ready.is_set()] if not _jobs else []
    for worker in starting:
        worker.stop(kill=True)


def _payload(name: str, subgraph: fx.GraphModule, vals: list[Any], grad_enabled: bool) -> bytes | None:
    from ..torch_internals import GraphPickler, GraphPicklerOptions, functorch_config, inductor_config

    settings = {
        "inductor": _picklable(inductor_config.get_config_copy()),
        "functorch": _picklable(functorch_config.get_config_copy()),
        "stampout": config.values(),
        "grad_enabled": grad_enabled,
        "threads": torch.get_num_threads(),
        "matmul": _matmul_settings(),
        # (AOTAutograd's key has "dynamic shapes": whether the placeholders' fake mode has a ShapeEnv)
        "shape_env": any(getattr(n.meta.get("val"), "fake_mode", None) is not None
                         and n.meta["val"].fake_mode.shape_env is not None
                         for n in subgraph.graph.nodes if n.op == "placeholder"),
        "class_name": type(subgraph).__name__,
    }
    try:
        graph = GraphPickler.dumps((subgraph, vals), GraphPicklerOptions(ops_filter=None))
        return pickle.dumps((name, settings, graph))
    except Exception as error:  # noqa: BLE001 - what cannot be sent is compiled here
        log.debug("inductor: region %s stays in this process (%s: %s)", name, type(error).__name__, error)
        return None


def _matmul_settings() -> tuple:
    matmul = torch.backends.cuda.matmul
    return (matmul.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction, torch.get_float32_matmul_precision())


def set_matmul_settings(settings: tuple) -> None:
    if _matmul_settings()[3] != settings[3]:
        torch.set_float32_matmul_precision(settings[3])
    matmul = torch.backends.cuda.matmul
    for name, value in zip(("fp32_precision", "allow_fp16_reduced_precision_reduction",
                            "allow_bf16_reduced_precision_reduction"), settings):
        if getattr(matmul, name) != value:
            setattr(matmul, name, value)


def _picklable(settings: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in settings.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a hook or callable setting: the worker keeps its own
            continue
        out[key] = value
    return out


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the worker process exited")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the worker process exited")
    return pickle.loads(data)


class _Worker:
    """One worker process and the thread that feeds it jobs from the queue."""

    def __init__(self) -> None:
        code = "from stampout.backends.region_worker import serve; serve()"
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (this stampout's)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env=env)
        STATS["workers_started"] += 1
        self.started = time.perf_counter()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._feed, name="stampout-region-worker", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive() and self.process.poll() is None

    def _feed(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            if receive(self.process.stdout) != ("ready", None):
                return
            self.ready.set()
            log.debug("inductor: a worker process is ready, %.1fs after its start", time.perf_counter() - self.started)
            while True:
                try:
                    job = _queue.get(timeout=IDLE_S / 2)
                except queue.Empty:
                    return
                with _lock:
                    if job.state != "queued":
                        continue
                    job.state = "running"
                try:
                    send(self.process.stdin, job.payload)
                    job.state, job.error = receive(self.process.stdout)
                except (OSError, EOFError, ValueError) as error:
                    job.state, job.error = "failed", f"{type(error).__name__}: {error}"
                    return
                finally:
                    job.finished.set()
        except (OSError, EOFError, ValueError):  # (the process exited, or shutdown() closed its pipe)
            return
        finally:
            self.stop()

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            if kill:
                self.process.kill()
                self.process.wait()
                return
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


@atexit.register
def shutdown() -> None:
    """Stop the worker processes (they start again when needed)."""
    with _lock:
        workers, _workers[:] = list(_workers), []
    for worker in workers:
        worker.stop()


# ---------------------------------------------------------------------------------------------- the worker
