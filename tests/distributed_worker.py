"""The scenarios of tests/test_fsdp.py, run on 2 gloo ranks by tests/distributed_ranks.py.

Each trains a sharded model eagerly and through stampout side by side, from the same initial weights, and
reports what the test compares: per step the loss difference and the largest difference of any
parameter's full gradient, stampout's region stats, and the captured graphs' code (to compare across ranks).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

import stampout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.n2 = RMSNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Llama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def sharded_llama(depth: int = 4, mixed: bool = False) -> nn.Module:
    """The Llama-like, each block and the root fully_shard'ed; `mixed`: with FSDP2 mixed precision (bf16
    parameters and inputs, fp32 gradient reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Llama(depth=depth)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model: nn.Module, step_fn, steps: int, seed: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Loss and full gradients of every parameter, per optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        target = torch.randint(0, 64, (2, 8), generator=gen)
        logits = step_fn(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        grads = {name: _full(p.grad).clone() if p.grad is not None else None for name, p in model.named_parameters()}
        out.append((loss.item(), grads))
        opt.step()
        opt.zero_grad()
    return out


def differences(eager: list, other: list) -> list[dict]:
    rows = []
    for (loss_e, grads_e), (loss_o, grads_o) in zip(eager, other):
        missing = sorted(n for n, g in grads_o.items() if g is None and grads_e[n] is not None)
        worst = max((float((grads_o[n] - g).abs().max()) for n, g in grads_e.items()
                     if g is not None and grads_o[n] is not None), default=0.0)
        rows.append({"loss": abs(loss_e - loss_o), "grad": worst, "missing": missing, "params": len(grads_e)})
        if os.environ.get("DEBUG_GRADS"):
            rows[-1]["each"] = {n: float((grads_o[n] - g).abs().max()) for n, g in grads_e.items() if g is not None}
    return rows


def world_after(model: nn.Module, ref: nn.Module) -> dict:
    """The model after training through stampout, against the eagerly trained one: parameters (what the
    optimizer made of the sharded gradients), still FSDP's sharded DTensors, no forward left on an instance."""
    from torch.distributed.tensor import DTensor

    params = dict(ref.named_parameters())
    return {
        "param": max(float((_full(p) - _full(params[n])).abs().max()) for n, p in model.named_parameters()),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "forwards": sorted(n for n, m in model.named_modules() if "forward" in m.__dict__),
    }


def region_code(cap) -> str:
    """The code of a capture's outer graph and of its region subgraphs, in name order."""
    parts = [cap.gm.code]
    for name, sub in sorted(cap.gm.named_modules()):
        if name and isinstance(sub, torch.fx.GraphModule):
            parts.append(f"# {name}\n{sub.code}")
    return "\n".join(parts)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def stampout_warnings() -> Iterator[list[str]]:
    """The messages stampout's loggers emit at WARNING or above meanwhile."""
    handler = _Warnings()
    logger = logging.getLogger("stampout")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def fsdp_compile(backends: str) -> dict:
    """Per backend: eager vs stampout.compile, 3 SGD steps (and what stampout warned of meanwhile); and eager vs
    stampout.capture."""
    ref = sharded_llama()
    eager = train(ref, ref, 3, 1)
    report: dict = {}
    for backend in backends.split(","):
        stampout.reset()
        model = sharded_llama()
        with stampout_warnings() as warned:
            compiled = stampout.compile(model, backend=backend)
            got = train(model, compiled, 3, 1)
        report[backend] = {"rows": differences(eager, got), "stats": stampout_stats(compiled),
                           "world": world_after(model, ref), "steady": steady_step(compiled), "warnings": warned}
    report["capture"] = fsdp_capture(ref, eager)
    return report


def fsdp_twins() -> dict:
    """Block 2 of the sharded Llama-like reads another eps: eager vs stampout.compile(aot_eager), 3 SGD steps. The
    other blocks take block 0's compiled entry (sharded_twins.py); block 2's guards fail on it: captured anew."""

    def make() -> nn.Module:
        model = sharded_llama()
        model.layers[2].n1.eps = 1e-2
        return model

    ref = make()
    eager = train(ref, ref, 3, 1)
    model = make()
    compiled = stampout.compile(model, backend="aot_eager")
    got = train(model, compiled, 3, 1)
    fn = compiled._compiled
    entries = [fn.pieces[f"layers.{i}"]._entries[0] for i in range(4)]
    shared = [e.capture is entries[0].capture for e in entries]
    predicates = [e.always is entries[0].always and e._full is entries[0]._full for e in entries]
    return {"rows": differences(eager, got), "stats": stampout_stats(compiled), "shared": shared,
            "predicates": predicates}


def steady_step(fn) -> dict:
    """One more training step of a compiled model after its first ones: whether the write epoch moved and how
    many entries ran their full guard check (FSDP's parameter swaps are checked per call: fsdp_swaps.py)."""
    from stampout.compile import entries as compiled_entries
    from stampout.watch.tracking import EPOCH

    refresh, calls = compiled_entries.Entry.refresh, []

    def counted(self, ctx):
        calls.append(1)
        return refresh(self, ctx)

    compiled_entries.Entry.refresh = counted
    try:
        before = EPOCH.value
        fn(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))).sum().backward()
        return {"epoch_moved": EPOCH.value != before, "full_checks": len(calls)}
    finally:
        compiled_entries.Entry.refresh = refresh


def fsdp_capture(ref: nn.Module, eager: list) -> dict:
    """eager (`ref`, trained to `eager`) vs stampout.capture of the sharded Llama-like: captured once, called for
    3 SGD steps."""
    model = sharded_llama()
    cap = stampout.capture(model, torch.zeros(2, 8, dtype=torch.long))
    got = train(model, cap, 3, 1)
    stats = cap.stats
    return {"rows": differences(eager, got), "world": world_after(model, ref),
            "stats": {"traces": stats.traces, "reuses": stats.reuses, "subgraphs": stats.subgraphs,
                      "placeholders": [n.name for n in cap.gm.graph.nodes if n.op == "placeholder"],
                      "code": region_code(cap), "lint": _lints(cap.gm)}}


def fsdp_mixed() -> dict:
    """FSDP2 mixed precision (bf16 compute, fp32 reduction): eager vs stampout.capture and compile(aot_eager),
    3 SGD steps each, and the dtypes the captured graph's boundaries hand on."""
    ref = sharded_llama(mixed=True)
    eager = train(ref, ref, 3, 1)
    model = sharded_llama(mixed=True)
    cap = stampout.capture(model, torch.zeros(2, 8, dtype=torch.long))
    got = train(model, cap, 3, 1)
    dtypes = sorted({str(n.meta["val"].dtype) for n in cap.gm.graph.nodes
                     if n.target is operator.getitem and isinstance(n.meta.get("val"), torch.Tensor)})
    report = {"capture": {"rows": differences(eager, got), "world": world_after(model, ref),
                          "stats": {"traces": cap.stats.traces, "reuses": cap.stats.reuses, "dtypes": dtypes,
                                    "code": region_code(cap)}}}
    stampout.reset()
    model = sharded_llama(mixed=True)
    compiled = stampout.compile(model, backend="aot_eager")
    got = train(model, compiled, 3, 1)
    report["aot_eager"] = {"rows": differences(eager, got), "world": world_after(model, ref)}
    return report


class Marked(nn.Module):
    """A user's region around a block whose attention and MLP are sharded on their own."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = Block(dim, 2)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) * 0.5


def nested_stack(kind: str) -> nn.Module:
    """A 2-block Stack, fully_shard'ed root; `marked`: each block inside a user's region, its attention and MLP
    sharded; `below`: each block sharded, and its MLP sharded below it."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack()
    if kind == "marked":
        model.layers = nn.ModuleList(Marked(16) for _ in range(2))
        for layer in model.layers:
            fully_shard(layer.block.attn)
            fully_shard(layer.block.mlp)
    else:
        for layer in model.layers:
            fully_shard(layer.mlp)
            fully_shard(layer)
    return fully_shard(model)


def fsdp_nested(kind: str) -> dict:
    """eager vs stampout.capture and compile(aot_eager) of `nested_stack(kind)`: per variant its rows, or the
    StampoutError it raised."""
    ref = nested_stack(kind)
    eager = _sgd_steps(ref, ref, 2)
    report: dict = {}
    for variant in ("capture", "aot_eager"):
        stampout.reset()
        model = nested_stack(kind)
        try:
            fn = (stampout.capture(model, torch.zeros(2, 4, 16)) if variant == "capture"
                  else stampout.compile(model, backend="aot_eager"))
            report[variant] = {"rows": differences(eager, _sgd_steps(model, fn, 2)),
                               "world": world_after(model, ref)}
        except stampout.StampoutError as error:
            report[variant] = {"error": str(error)}
    return report


def _lints(gm: torch.fx.GraphModule) -> bool:
    gm.graph.lint()
    return True


class Stack(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, 2) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def fsdp_inductor() -> dict:
    """A tiny stack of 2 sharded blocks through Inductor: one region compiled, gradients as eager's."""
    from torch.distributed.fsdp import fully_shard

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = Stack()
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)

    ref, model = make(), make()
    eager = _sgd_steps(ref, ref, 2)
    compiled = stampout.compile(model, backend="inductor")
    got = _sgd_steps(model, compiled, 2)
    return {"rows": differences(eager, got), "stats": stampout_stats(compiled), "world": world_after(model, ref)}


def _sgd_steps(model: nn.Module, fn, steps: int) -> list:
    """`steps` SGD steps of `fn` (the model or its compiled form) on 2x4x16 inputs: each step's loss and full grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step))
        loss = fn(x).pow(2).mean()
        loss.backward()
        out.append((loss.item(), {n: _full(p.grad).clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def tensor_parallel(backends: str, regions: str = "auto", mixed: str = "") -> dict:
    """A stack of 4 MLP blocks, tensor parallel on 2 ranks (gate/up column-wise, down row-wise); `mixed`: the
    last two blocks' column-wise outputs stay DTensors (use_local_output=False)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*(MLPBlock(16) for _ in range(4)))
        for i, block in enumerate(model):
            local = not (mixed and i >= 2)  # (else gate and up hand DTensors to down: other hook arguments)
            parallelize_module(block.mlp, mesh, {"gate": ColwiseParallel(use_local_output=local),
                                                 "up": ColwiseParallel(use_local_output=local),
                                                 "down": RowwiseParallel()})
        return model

    ref = make()
    eager = _sgd_steps(ref, ref, 3)
    report = {}
    for name in backends.split(","):
        stampout.reset()
        model = make()
        compiled = stampout.compile(model, backend=name, regions=regions)
        got = _sgd_steps(model, compiled, 3)
        report[name] = {"rows": differences(eager, got), "stats": stampout_stats(compiled)}
    return report


def sharded_hf_llama(depth: int = 2) -> nn.Module:
    """A transformers Llama with fully_shard per decoder layer and on the root, as torchtitan shards it."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.disable_compile = True
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def hf_llama(backend: str, how: str = "module") -> dict:
    """eager vs stampout.compile of an HF Llama sharded per decoder layer (logits from its output); `how`:
    `module` compiles the model, `forward` its bound forward (`model.forward = stampout.compile(model.forward)`)."""
    ref = sharded_hf_llama()
    eager = train(ref, lambda ids: ref(input_ids=ids, use_cache=False).logits, 3, 1)
    model = sharded_hf_llama()
    with stampout_warnings() as warned:
        if how == "forward":  # (the Hugging Face recipe: FSDP's hooks of the root run in the model's own __call__)
            model.forward = compiled = stampout.compile(model.forward, backend=backend)
            call = model
        else:
            compiled = call = stampout.compile(model, backend=backend)
        got = train(model, lambda ids: call(input_ids=ids, use_cache=False).logits, 3, 1)
    return {"rows": differences(eager, got), "stats": stampout_stats(compiled), "world": world_after(model, ref),
            "warnings": warned}


def stampout_stats(compiled) -> dict:
    fn = getattr(compiled, "_compiled", compiled)
    captures = sharded_captures(fn)
    return {  # (a sharded block taking a sibling's entry is a region reuse: sharded_twins.py)
        "traces": fn.stats.traces,
        "reuses": fn.stats.reuses,
        "captures": len(captures),
        "recaptures": fn.stats.captures,  # (the root's stats count its pieces')
        "public": public_view(compiled),
        "region_compiles": len({id(e.compiled) for f in compiled_functions(fn) for e in f._entries
                                if e.capture is not None and "invoke_subgraph" in e.capture.gm.code}),
        "code": "\n".join(region_code(c) for c in captures),
        "breaks": [b.describe() for b in getattr(fn, "breaks", [])],
        "misses": [e.reason for c in captures for e in c.events if e.outcome != "reused"][1:2],
    }


def public_view(compiled) -> dict:
    """What a user of stampout.compile sees of it (stats, the last graph, explain) without walking its pieces."""
    stats, last = compiled.stats, compiled.last_capture
    return {"stats": [stats.captures, stats.traces, stats.reuses], "last_code": last.gm.code if last else None,
            "explain_pieces": compiled.explain().count("\n  piece "),
            "glue": [line.split("in its code: ")[1] for line in compiled.explain().splitlines()
                     if "leaf children run eagerly in its code" in line],
            "guard_code": "no compiled entry" not in compiled.guard_code()}


def compiled_functions(fn) -> list:
    from stampout.compile.stats import compiled_family  # (the compiled function and its pieces, root first)

    return compiled_family(fn)


def sharded_captures(fn) -> list:
    """The distinct captures behind a compiled function and its piecewise-compiled children, root first."""
    found = []
    stack = [fn]
    while stack:
        f = stack.pop(0)
        for entry in getattr(f, "_entries", ()):
            if entry.capture is not None and all(entry.capture is not c for c in found):
                found.append(entry.capture)
        stack.extend(f.pieces[p] for p in sorted(f.pieces))
    return found


SCENARIOS = {"fsdp_compile": fsdp_compile, "fsdp_twins": fsdp_twins, "fsdp_mixed": fsdp_mixed,
             "fsdp_nested": fsdp_nested, "hf_llama": hf_llama, "fsdp_inductor": fsdp_inductor, "tp": tensor_parallel}
