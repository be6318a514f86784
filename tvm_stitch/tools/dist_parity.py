"""Data-parallel training with backend="tvm_stitch" against eager, in several processes (DDP, FSDP2).

Each rank trains two copies of one seeded model on its own batches: one
eager, one compiled with a tvm_stitch backend, both wrapped alike (DDP or
FSDP2's `fully_shard` per block). It records both runs' losses and final
parameters, the backend's counters, the eager-fallback warnings and,
where asked, the order in which the backward's TVM parts and collectives
started (from torch.profiler: each part runs under a
`tvm_stitch: part_N` range). `launch(case)` spawns the ranks on
127.0.0.1 (a free port) and returns each rank's record.

    python -m tvm_stitch.tools.dist_parity ddp            # 2 processes, gloo on the CPU
    torchrun --nproc-per-node 8 -m tvm_stitch.tools.dist_parity fsdp2 --device cuda   # NCCL, a GPU a rank
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from dataclasses import asdict, dataclass

from tvm_stitch.environment import environment_set

MODELS = ("tiny", "llama")
PROFILED_NAMES = ("tvm_stitch: part", "_c10d_functional::all_reduce")


@dataclass(frozen=True)
class Case:
    """wrap: "ddp" or "fsdp2"; optimizer: "sgd" or "adamw"; optimize_ddp: dynamo's setting (True,
    False, "python_reducer": the step compiled whole under compiled autograd); bucket_cap_mb: DDP's
    (None: its default); model: "tiny" (two MLP blocks, hidden 16) or "llama" (tools.models' "test")."""

    wrap: str = "ddp"
    optimizer: str = "sgd"
    optimize_ddp: object = True
    bucket_cap_mb: float | None = None
    model: str = "tiny"
    steps: int = 3
    record_order: bool = False


CASES = {
    "ddp": Case(optimizer="adamw"),
    "ddp-small-buckets": Case(bucket_cap_mb=0.001),
    "ddp-compiled-autograd": Case(optimize_ddp="python_reducer", bucket_cap_mb=0.0005, record_order=True),
    "fsdp2": Case(wrap="fsdp2", optimizer="adamw"),
    "ddp-llama": Case(optimizer="adamw", optimize_ddp="python_reducer", model="llama"),
}


def tiny_model():
    """(model, one rank's batch maker): two pre-norm MLP blocks (RMSNorm, SiLU) and a final RMSNorm."""
    import torch

    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Block(nn.Module):
        def __init__(self, d, hidden):
            super().__init__()
            self.norm, self.up, self.down = RMSNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

        def forward(self, x):
            return x + self.down(nn.functional.silu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self, d=16, hidden=32):
            super().__init__()
            self.blocks = nn.ModuleList([Block(d, hidden), Block(d, hidden)])
            self.norm = RMSNorm(d)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    torch.manual_seed(0)
    return Stack(), (lambda: torch.randn(4, 8, 16))


def _model(name: str):
    import torch

    if name == "tiny":
        return tiny_model()
    from tvm_stitch.tools.models import make_model

    model, (example,) = make_model("llama", "test")
    return model.train(), (lambda: torch.randn_like(example))


def _wrap(model, case: Case, device):
    import torch

    if case.wrap == "ddp":
        options = {} if case.bucket_cap_mb is None else {"bucket_cap_mb": case.bucket_cap_mb}
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **options)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _optimizer(case: Case, params):
    import torch

    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _compiled_step(wrapped, case: Case, backend):
    """loss(x) -> the loss after its backward, the model (or its blocks) compiled with `backend`."""
    import torch

    def step(x):
        return _eager_step(wrapped, x)

    if case.optimize_ddp == "python_reducer":
        torch._dynamo.config.compiled_autograd = True
        return torch.compile(step, backend=backend)
    if case.wrap == "fsdp2":
        for block in wrapped.blocks:
            block.compile(backend=backend)
        return step
    compiled = torch.compile(wrapped, backend=backend)
    return lambda x: _eager_step(compiled, x)


def _eager_step(model, x):
    """The loss (reconstructing the input: every parameter gets a gradient of its size) after its backward."""
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _train(step, optimizer, batches, profile_last: bool) -> tuple[list, list, list]:
    """(losses, order of the last step's TVM parts and all-reduces as (name, start in µs), seconds a step)."""
    import time

    import torch

    losses, order, seconds = [], [], []
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        profiled = profile_last and index == len(batches) - 1
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                losses.append(float(step(batch)))
            order = sorted((e.time_range.start, e.name) for e in profiler.events()
                           if e.name.startswith(PROFILED_NAMES))
        else:
            losses.append(float(step(batch)))
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return losses, [(name, start) for start, name in order], seconds


def _parameters(model) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def worker(rank: int, world: int, port: int, case: Case, out_dir: str, device_kind: str = "cpu") -> None:
    """One rank: eager and compiled training of `case`, its record saved as `out_dir`/rank<rank>.pt."""
    import torch
    import torch.distributed as dist

    import tvm_stitch.torch as stitch_torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_kind, rank if device_kind == "cuda" else None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        record = _run_rank(case, rank, device, stitch_torch.backend())
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_rank(case: Case, rank: int, device, backend) -> dict:
    import torch

    from tvm_stitch.torch import EagerFallbackWarning

    (eager_model, batch), (model, _) = _model(case.model), _model(case.model)
    torch._dynamo.config.optimize_ddp = True  # the eager copy keeps DDP's own reducer
    eager = _wrap(eager_model.to(device), case, device)
    torch._dynamo.config.optimize_ddp = case.optimize_ddp
    compiled = _wrap(model.to(device), case, device)
    torch.manual_seed(1 + rank)
    batches = [batch().to(device) for _ in range(case.steps)]
    eager_losses, _, eager_seconds = _train(lambda x: _eager_step(eager, x), _optimizer(case, eager.parameters()),
                                            batches, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, order, seconds = _train(_compiled_step(compiled, case, backend),
                                        _optimizer(case, compiled.parameters()), batches, case.record_order)
    return {"losses": losses, "eager_losses": eager_losses, "parameters": _parameters(compiled),
            "eager_parameters": _parameters(eager), "counters": asdict(backend.counters), "order": order,
            "seconds": seconds, "eager_seconds": eager_seconds,
            "fallback_warnings": [str(w.message) for w in caught if issubclass(w.category, EagerFallbackWarning)]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(case: Case, world: int = 2, env: dict | None = None) -> list:
    """Each rank's record of `case`, run in `world` processes spawned on this machine (gloo, CPU);
    `env`: environment variables the ranks get (set in this process while they start)."""
    import torch
    import torch.multiprocessing as mp

    with environment_set(env or {}), tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(world, free_port(), case, out_dir), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def largest_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two parameter dicts (same names)."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def summary(record: dict) -> str:
    """One rank's record in a line: the largest loss and parameter differences to eager, the counters."""
    loss = max(abs(a - b) for a, b in zip(record["losses"], record["eager_losses"]))
    parameters = largest_difference(record["parameters"], record["eager_parameters"])
    steps = ", ".join(f"{s:.3g}" for s in record["seconds"])
    return (f"loss diff {loss:.3g}, parameter diff {parameters:.3g}, {record['counters']}, "
            f"{len(record['fallback_warnings'])} eager-fallback warning(s), steps {steps} s")


def main(argv=None) -> None:
    """`python -m tvm_stitch.tools.dist_parity CASE`: 2 ranks spawned on this CPU (gloo); under torchrun
    (RANK set), this process is one rank, on GPU LOCAL_RANK with NCCL for `--device cuda`."""
    import argparse

    import torch
    import torch.distributed as dist

    import tvm_stitch.torch as stitch_torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2, help="processes to spawn without torchrun")
    args = parser.parse_args(argv)
    case = CASES[args.case]
    if "RANK" not in os.environ:
        for rank, record in enumerate(launch(case, args.world)):
            print(f"rank {rank}: {summary(record)}")
        return
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        print(f"rank {dist.get_rank()}: {summary(_run_rank(case, dist.get_rank(), device, stitch_torch.backend()))}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
