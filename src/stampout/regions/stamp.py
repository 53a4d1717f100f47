"""Stamping out a region call from a reuse entry: no Python of the region runs; its outputs are new fakes from
the traced call's metadata and the parent graph gets `invoke_subgraph` and one getitem per output."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..backends.runner import as_call_modules
from ..sources import CallContext
from ..torch_internals import FakeTensor, append_node, invoke_subgraph
from ..trace.builder import Builder, map_tensors
from ..trace.structure import build
from ..trace.tensormeta import OutputMeta, output_meta
from .cache import Output, ReuseEntry, Store
from .events import Outcome
from .marker import Region


class Stamping:
    """Stamping out a call from a reuse entry (a part of RegionCalls)."""

    def _stamp(self, region: Region, entry: ReuseEntry, leaves: list[Any], values: list[Any], site: str,
               rg: tuple) -> Any:
        parent = self.tracer.builder
        for frame in self.frames:
            frame.import_entry(entry, leaves, region.fn, values)
        operands = [parent.node_for(v) for v in values]
        out_meta = entry.out_meta.get(rg)
        if out_meta is None:
            out_meta = entry.out_meta[rg] = self._propagate(entry, values)
        fakes = [self._fake(meta) for meta in out_meta]
        holes = []
        for kind, i, *view in entry.outputs:
            if kind is Output.VIEW:  # a view of output i
                holes.append(torch.as_strided(fakes[i], *view))
            elif kind is Output.IN_VIEW:  # a view of operand i, at the same place relative to it
                size, stride, relative = view
                base = values[i] if isinstance(values[i], FakeTensor) else self.tracer.fake_of(values[i])
                holes.append(torch.as_strided(base, size, stride, base.storage_offset() + relative))
            else:
                holes.append(fakes[i] if kind is Output.OUT else values[i])
        self._emit(parent, entry, operands, holes, fakes)
        if entry.stores:
            self._repeat_stores(entry, CallContext(leaves, region.fn), holes, values)
        self.stats.reuses += 1
        self._record(region, site, Outcome.REUSED, "", entry.subgraph)
        return build(entry.template, holes)

    def _repeat_stores(self, entry: ReuseEntry, ctx: CallContext, holes: list, values: list) -> None:
        """What the traced call stored, stored by this stamped call on its own objects (through their
        `__setattr__`, so enclosing traces and the program see the writes; `stored` keeps the objects, whose
        traced values the capture then makes real as it does the traced call's)."""
        memo: dict = {}
        for target, name, (kind, value) in entry.stores:
            obj = target.resolve(ctx, memo)
            self.stored[id(obj)] = obj
            if kind is Store.MISSING:
                if hasattr(obj, name):
                    delattr(obj, name)
                continue
            setattr(obj, name, value if kind is Store.CONST else holes[value] if kind is Store.HOLE else values[value])

    def _propagate(self, entry: ReuseEntry, values: list[Any]) -> list[OutputMeta]:
        """Output metadata of the entry's subgraph for inputs that differ only in requires_grad (its nested region
        calls run as their subgraphs: invoke_subgraph refuses gradients through one that writes its inputs)."""
        inputs = [self.tracer.fake_of(v) if isinstance(v, torch.Tensor) else v for v in values]
        outs = fx.Interpreter(as_call_modules(entry.gm)).run(*inputs)
        return [output_meta(t) for t in outs]

    def _fake(self, meta: OutputMeta) -> torch.Tensor:
        """An output of a stamped call: computed by it, so (like the traced call's) it stands for no autograd
        leaf when it requires grad — in-place ops on it work as on the meta path's outputs (MetaRunner.mutate),
        without a clone through the fake mode (~150 us a stamped layer)."""
        fake = self.tracer.new_fake(*meta)
        if fake.requires_grad:
            self.tracer.meta.adopt(fake)
        return fake

    def _emit(self, builder: Builder, entry: ReuseEntry, operands: list[fx.Node], holes: list,
              out_fakes: list) -> None:
        """Append `invoke_subgraph(subgraph, name, *operands)`, one getitem per output, and the views the
        region returned of one of them, to `builder`."""
        builder.submodules[entry.subgraph] = entry.gm
        graph = builder.graph
        sub = append_node(graph, "get_attr", entry.subgraph)
        call = invoke_subgraph(graph, sub, entry.subgraph, operands)
        outs = [append_node(graph, "call_function", operator.getitem, (call, i)) for i in range(entry.n_outputs)]
        call.meta["stack_trace"] = f"  File {entry.call_site}\n"
        for out, fake in zip(outs, out_fakes):
            out.meta["val"] = fake
        for (kind, i, *view), value in zip(entry.outputs, holes):
            if kind is Output.OUT:
                builder.bind(value, outs[i])
            elif kind is Output.VIEW:
                node = graph.call_function(torch.as_strided, (outs[i], *map_tensors(view, builder.node_for, True)))
                node.meta["val"] = value
                builder.bind(value, node)
            elif kind is Output.IN_VIEW:
                where = (view[0], view[1], value.storage_offset())
                node = graph.call_function(torch.as_strided,
                                           (operands[i], *map_tensors(where, builder.node_for, True)))
                node.meta["val"] = value
                builder.bind(value, node)
        for out, fake in zip(outs, out_fakes):
            builder.bind(fake, out)
        call.meta["val"] = tuple(out_fakes)
