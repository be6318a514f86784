"""Attention in transformers' BERT, GPT-2 and LLaMA: CUDA launches per forward, and LLaMA's CPU forward.

Usage:
  python benchmarks/attention_models.py launches [SEQ]      # CUDA sm_90 build counts, batch 1
  python benchmarks/attention_models.py export DIR [SEQ]    # LLaMA's llvm build, saved as DIR/stitched.so
  python benchmarks/attention_models.py cpu BEFORE.so AFTER.so [SEQ] [ROUNDS]
  python benchmarks/attention_models.py profile BEFORE.so AFTER.so [SEQ] [ROUNDS]
  python benchmarks/attention_models.py kernel [SEQ] [ROUNDS]
The `export` of the checkout before a change and of the one after, then `cpu`, times both builds
and PyTorch eager (its sdpa and its eager attention) in alternating rounds in one process;
`profile` times each kernel of both builds (the VM's instrument hook, alternating rounds);
`kernel` times the fused CPU kernel alone at LLaMA's attention shape (batch 1, 8 query heads over
4 KV heads, head dim 64, causal, float32 Q, K, V tensors) against PyTorch's sdpa of the same.
Needs the torch extra.
"""

import sys
import time

import numpy as np

MODELS = ("bert", "gpt2-hf", "llama-hf")


def _imported(name: str, seq: int, attention: str = "eager"):
    import torch

    from tvm_stitch.frontend import from_torch
    from tvm_stitch.tools.models import make_model

    model, (ids,) = make_model(name, "bench")
    vocab = model.config.vocab_size if hasattr(model, "config") else model.bert.config.vocab_size
    inner = model.bert if hasattr(model, "bert") else model
    inner.config._attn_implementation = attention
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    return model, ids, from_torch(model, (ids,))


def launches(seq: int = 512) -> None:
    from tvm_stitch.tools.build import build
    from tvm_stitch.tools.launches import launches_by_kind, primfunc_calls, program_traffic

    gpu = {"kind": "cuda", "arch": "sm_90"}
    print(f"| model (batch 1 x {seq}) | memory-intensive launches | compute-intensive | fused attention "
          "launches | modeled MB |\n|---|---|---|---|---|")
    for name in MODELS:
        _, _, mod = _imported(name, seq)
        built = build(mod, gpu, stitched=True)
        memory, compute = launches_by_kind(built.lowered, built.executable)
        fused = sum(n for f, n in primfunc_calls(built.lowered).items() if f.startswith("fused_attention"))
        print(f"| {name} | {memory} | {compute} | {fused} | {program_traffic(built.lowered, gpu)[0] / 1e6:.0f} |",
              flush=True)
        for record in getattr(built.report, "attention", []):
            print(f"  {record.line()}", file=sys.stderr)


def export(directory: str, seq: int = 1024) -> None:
    from tvm_stitch.target import host_target
    from tvm_stitch.tools.build import build

    _, _, mod = _imported("llama-hf", seq)
    built = build(mod, host_target(), stitched=True)
    built.executable.export_library(f"{directory}/stitched.so")
    print(f"exported {directory}/stitched.so (compiled in {built.compile_seconds:.1f} s)")


def cpu(before: str, after: str, seq: int = 1024, rounds: int = 5) -> None:
    import torch
    import tvm
    from tvm import relax

    model, ids, _ = _imported("llama-hf", seq)
    vms = {label: relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
           for label, path in (("before", before), ("after", after))}
    arg = tvm.runtime.tensor(ids.numpy())
    outputs = {label: vm["main"](arg) for label, vm in vms.items()}
    first = {label: (out[0] if not hasattr(out, "numpy") else out).numpy() for label, out in outputs.items()}
    with torch.no_grad():
        want = model(ids).last_hidden_state.numpy()
    for label, got in first.items():
        print(f"{label}: max |tvm - torch| {np.abs(got - want).max():.2e}")
    runs = {"before": lambda: vms["before"]["main"](arg), "after": lambda: vms["after"]["main"](arg)}
    for attention in ("sdpa", "eager"):
        def run_torch(attention=attention):
            model.config._attn_implementation = attention
            with torch.no_grad():
                model(ids)
        runs[f"torch {attention}"] = run_torch
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    base = min(times["before"])
    for label, values in times.items():
        print(f"{label}: best {min(values) * 1e3:.0f} ms, median {np.median(values) * 1e3:.0f} ms "
              f"({base / min(values):.2f}x the build before)")


def profile(before: str, after: str, seq: int = 1024, rounds: int = 5) -> None:
    """Per kernel of each build: calls per forward and median milliseconds per forward over `rounds`."""
    import collections

    import tvm
    from tvm import relax

    ids = tvm.runtime.tensor(np.random.default_rng(0).integers(0, 1000, (1, seq)).astype("int64"))
    spent = {label: collections.defaultdict(list) for label in ("before", "after")}
    vms = {}
    for label, path in (("before", before), ("after", after)):
        vms[label] = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
        vms[label].set_instrument(_timer(spent[label]))
        vms[label]["main"](ids)
    for label in spent:
        spent[label].clear()
    for _ in range(rounds):
        for label, vm in vms.items():
            vm["main"](ids)
    for label, kernels in spent.items():
        per_forward = {name: (len(times) // rounds, float(np.median(np.add.reduceat(times, range(0, len(times),
                                                                                                 len(times) // rounds)))))
                       for name, times in kernels.items() if not name.startswith("vm.builtin")}
        print(f"{label}: kernels {sum(t for _, t in per_forward.values()) * 1e3:.1f} ms per forward (median per kernel)")
        for name, (calls, t) in sorted(per_forward.items(), key=lambda item: -item[1][1]):
            print(f"  {t * 1e3:7.2f} ms  {calls} x {name}")


def kernel(seq: int = 1024, rounds: int = 7) -> None:
    import torch
    import tvm

    from tvm_stitch.rewrites.attention import kernel_for
    from tvm_stitch.planning.attention import AttentionShape, plan_attention
    from tvm_stitch.planning.spec import TargetSpec
    from tvm_stitch.target import host_target

    shape = AttentionShape(1, 8, 4, seq, seq, 64, "float32", 0.125, "causal")
    plan = plan_attention(shape, TargetSpec.from_target(host_target()))
    lib = tvm.tirx.build(tvm.IRModule({"main": kernel_for(plan).with_attr("global_symbol", "main")}),
                         target=host_target())
    q, k, v = (torch.randn(1, h, seq, 64) for h in (8, 4, 4))
    out = tvm.runtime.empty((1, 8, seq, 64), "float32", tvm.cpu())
    args = [tvm.runtime.tensor(t.numpy()) for t in (q, k, v)] + [out]
    with torch.no_grad():
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    lib["main"](*args)
    print(f"{plan.describe()}\nmax |fused - sdpa| {np.abs(out.numpy() - want.numpy()).max():.2e}")
    runs = {"fused kernel": lambda: lib["main"](*args),
            "torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                   enable_gqa=True)}
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            start = time.perf_counter()
            with torch.no_grad():
                run()
            times[label].append(time.perf_counter() - start)
    for label, values in times.items():
        print(f"{label}: best {min(values) * 1e3:.2f} ms, median {np.median(values) * 1e3:.2f} ms")


def _timer(spent):
    """A VM instrument recording each call's wall time under the callee's name."""
    started = {}

    def instrument(_func, name, before_run, _ret, *_args):
        if before_run:
            started[name] = time.perf_counter()
        else:
            spent[name].append(time.perf_counter() - started[name])
        return 0

    return instrument


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "launches":
        launches(*map(int, rest))
    elif mode == "export":
        export(rest[0], *map(int, rest[1:]))
    elif mode == "kernel":
        kernel(*map(int, rest))
    elif mode == "profile":
        profile(rest[0], rest[1], *map(int, rest[2:]))
    else:
        cpu(rest[0], rest[1], *map(int, rest[2:]))
