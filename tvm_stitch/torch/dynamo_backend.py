"""The dynamo backend: aot_autograd's forward, backward and inference graphs built with the stitch pipeline.

Dynamo hands the backend a Torch-level FX graph; aot_autograd turns it
into functionalised ATen graphs (with PyTorch's core ATen
decompositions, so composite ops arrive as the element-wise ops and
reductions that stitch) and, when an input requires grad, into a forward
and a backward split by the min-cut rematerialisation partitioner: it
saves few tensors and recomputes cheap memory-bound producers in the
backward, where they join the stitched kernels that read them instead of
being written and read back. Each graph is imported (graph_import),
built with `tvm_stitch.pipeline(target)` and run on TVM's VM (runner);
builds are cached (cache); what cannot be imported or built runs on
PyTorch eager (eager).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm

from tvm_stitch.pipeline import pipeline
from tvm_stitch.stitch import DEFAULT_FUSION, FUSION_METHODS
from tvm_stitch.target import as_target, default_pipeline
from tvm_stitch.torch.build_claim import BuildClaim
from tvm_stitch.torch.cache import CompileCache, Counters, graph_key
from tvm_stitch.torch.cache_store import CACHE_DIR_VARIABLE
from tvm_stitch.torch.collectives import has_collectives, split_at_collectives
from tvm_stitch.torch.decompositions import attention_as_math, decompositions
from tvm_stitch.torch.device import check_target_matches, input_device, target_for, tvm_device
from tvm_stitch.torch.eager import EagerFallback, split_unsupported, warn_eager
from tvm_stitch.torch.foreach import foreach_as_loops
from tvm_stitch.torch.errors import BuildFailed, CannotBuild, UnsupportedGraph
from tvm_stitch.torch.graph_import import NOT_OPS, import_graph, unsupported_nodes
from tvm_stitch.torch.nodes import graph_module_path, op_name
from tvm_stitch.torch.runner import BuiltGraph


@dataclass(frozen=True)
class Options:
    """target: None (from the inputs' device) or a Target / dict / string; strict: raise instead of
    running on eager (and StitchFusion's strict mode); fast_math: as `tvm_stitch.pipeline`'s (None: on
    for llvm); fusion: "search" (default) or "greedy", the grouping of `tvm_stitch.pipeline` (docs/fusion-search.md),
    or False: TVM's default pipeline (no stitching); cache: True (memory,
    and disk where TVM_STITCH_CACHE_DIR is set), False (none) or a directory for the disk cache;
    allow_tf32: float32 GEMMs on TF32 tensor cores, as `tvm_stitch.pipeline`'s (off by default, the
    convention of `torch.backends.cuda.matmul.allow_tf32`)."""

    target: object = None
    strict: bool = False
    fast_math: bool | None = None
    fusion: str | bool = DEFAULT_FUSION
    cache: bool | str = True
    allow_tf32: bool = False

    def __post_init__(self):
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be True or False, not {self.strict!r}")
        if self.fusion is not False and self.fusion not in FUSION_METHODS:
            raise TypeError(f"fusion must be one of {', '.join(map(repr, FUSION_METHODS))} or False, "
                            f"not {self.fusion!r}")
        if self.fast_math is not None and not isinstance(self.fast_math, bool):
            raise TypeError(f"fast_math must be True, False or None, not {self.fast_math!r}")
        if not isinstance(self.allow_tf32, bool):
            raise TypeError(f"allow_tf32 must be True or False, not {self.allow_tf32!r}")
        if not isinstance(self.cache, (bool, str)):
            raise TypeError(f"cache must be True, False or a directory, not {self.cache!r}")

    def build_options(self) -> tuple:
        """What a build depends on, for the cache key: every option but where the cache is (allow_tf32
        only where on: the keys of builds without it stay as they were)."""
        tf32 = ("allow_tf32",) if self.allow_tf32 else ()
        return (self.target, self.strict, self.fast_math, self.fusion, *tf32)


class Backend:
    """A `torch.compile` backend: `torch.compile(model, backend=Backend(...))`; `counters` says what it did."""

    def __init__(self, **options):
        self.options = Options(**options)
        if self.options.target is not None:
            as_target(self.options.target)  # a bad target is refused here, not at the first call
        cache = self.options.cache
        directory = cache if isinstance(cache, str) else os.environ.get(CACHE_DIR_VARIABLE)
        self.cache = CompileCache(directory) if cache else None
        self.counters = Counters()

    def __call__(self, gm, example_inputs):
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.exc import TorchDynamoException

        compiler = aot_autograd(fw_compiler=self.compile_graph, bw_compiler=self.compile_graph,
                                partition_fn=min_cut_rematerialization_partition,
                                decompositions=decompositions())
        attention_as_math(gm)
        try:
            return compiler(gm, example_inputs)
        except TorchDynamoException:
            raise  # dynamo's own signals (a restart of its analysis) and errors
        except Exception as err:  # noqa: BLE001 - aot_autograd failing on a graph: dynamo's graph runs on eager
            if self.options.strict:
                raise
            self.counters.eager_fallbacks += 1
            warn_eager(f"aot_autograd failed on a graph of {graph_module_path(gm)}, which runs on PyTorch eager "
                       f"({type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''})")
            return gm.forward

    def compile_graph(self, gm, example_inputs):
        """A boxed callable running the ATen graph `gm` on TVM, or on eager (parts of it) where TVM cannot."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        foreach_as_loops(gm)
        if has_collectives(gm.graph):  # torch runs the collectives, TVM the parts between them
            return split_at_collectives(gm, self.compile_graph)
        with unset_fake_temporarily():  # aot_autograd calls compilers under its fake mode; constants are real
            return self._compile_graph(gm, example_inputs)

    def _compile_graph(self, gm, example_inputs):
        excluded = set()  # ops whose converter raised on this graph: they run on eager, the rest on TVM
        while True:
            try:
                device = input_device(example_inputs)
                target = target_for(device, self.options.target)
                check_target_matches(target, device)
                eager_ops = {op_name(n) for n in unsupported_nodes(gm.graph)} | excluded
                if eager_ops and not self.options.strict:
                    split = split_unsupported(gm, example_inputs, eager_ops, self._build_part, self._fallback)
                    self.counters.eager_fallbacks += not isinstance(split, EagerFallback)  # else counted there
                    return split
                return self._build(gm, example_inputs, device, target)
            except CannotBuild as err:
                if self.options.strict:
                    raise
                if not isinstance(err, UnsupportedGraph) or err.op in excluded | NOT_OPS:
                    return self._fallback(gm, err)
                excluded.add(err.op)

    def _build_part(self, gm, example_inputs):
        device = input_device(example_inputs)
        return self._build(gm, example_inputs, device, target_for(device, self.options.target))

    def _build(self, gm, example_inputs, device, target):
        imported = import_graph(gm, example_inputs)
        if imported.mod is None:
            return BuiltGraph(None, None, imported)
        key = (graph_key(gm, example_inputs, target, self.options.build_options(), self.cache.versions)
               if self.cache is not None else None)
        with BuildClaim(self.cache, key, target) as claim:  # with a shared disk cache, one process builds, others load
            executable, where = claim.found
            if executable is None:
                executable = _compile(imported.mod, target, self.options)
                self.counters.compiles += 1
                if self.cache is not None:
                    self.cache.put(key, target, executable)
            else:
                self.counters.cache_hits += 1
                self.counters.disk_hits += where == "disk"
        return BuiltGraph(executable, tvm_device(device), imported)

    def _fallback(self, gm, err):
        self.counters.eager_fallbacks += 1
        return EagerFallback(gm, err)


def _compile(mod, target, options: Options):
    try:
        passes = (pipeline(target, strict=options.strict, fast_math=options.fast_math, fusion=options.fusion,
                           allow_tf32=options.allow_tf32)
                  if options.fusion else default_pipeline(target))
        with target:
            lowered = passes(mod)
        return tvm.compile(lowered, target=target, relax_pipeline=None)
    except Exception as err:  # noqa: BLE001 - a graph TVM cannot build runs on eager, with the reason
        if options.strict:
            raise
        lines = str(err).strip().splitlines()
        raise BuildFailed(f"{type(err).__name__}: {lines[-1][:300] if lines else ''}") from err
