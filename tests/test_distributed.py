"""DDP and FSDP2 training with backend="tvm_stitch" in 2 processes (gloo on 127.0.0.1) against eager."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from tvm_stitch.tools.dist_parity import CASES, launch, largest_difference  # noqa: E402
from tvm_stitch.torch.build_claim import CLAIM_SUFFIX, BuildClaim  # noqa: E402

PART, ALL_REDUCE = "tvm_stitch: part", "_c10d_functional::all_reduce"
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-4}


def _two_reductions(a, b):
    import torch.distributed._functional_collectives as funcol

    group = torch.distributed.group.WORLD
    first = funcol.all_reduce(a * 2, "sum", group)
    second = funcol.all_reduce(torch.sin(b) * b, "sum", group)
    return first + 1, second * 3


def _sequence(split) -> list:
    """The split graph's calls in order: "part" for a TVM part, else the collective's name."""
    return ["part" if n.op == "call_module" else n.target._opname for n in split.graph.nodes
            if n.op == "call_module" or getattr(n.target, "namespace", None) == "_c10d_functional"]


@pytest.mark.parametrize("fused, expected", [
    (False, ["part", "all_reduce", "part", "all_reduce", "wait_tensor", "wait_tensor", "part"]),
    (True, ["part", "all_reduce", "wait_tensor", "part"])])
def test_collectives_are_issued_early_waited_late_and_run_by_torch_between_tvm_parts(one_rank, monkeypatch,
                                                                                     fused, expected):
    """The traced graph waits for each all-reduce at once; split, each is issued as soon as its input is
    computed and waited for after all other work (fused into one bucket where DDP asks for fusion)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import tvm_stitch.torch

    monkeypatch.setattr(torch._inductor.config, "_fuse_ddp_communication", fused)
    a, b = torch.randn(4, 3), torch.randn(5)
    gm = make_fx(_two_reductions, tracing_mode="fake")(a, b)
    assert [n.target._opname for n in gm.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"] \
        == ["all_reduce", "wait_tensor", "all_reduce", "wait_tensor"]
    backend = tvm_stitch.torch.backend()
    compiled = backend.compile_graph(gm, [a, b])
    assert _sequence(compiled.gm) == expected
    assert backend.counters.compiles == expected.count("part") and backend.counters.eager_fallbacks == 0
    for out, ref in zip(compiled([a, b]), _two_reductions(a, b)):
        torch.testing.assert_close(out, ref)


class _Cache:
    """A compile cache's interface over a dict, standing in for another process's, its disk usable."""

    def __init__(self, directory):
        self.disk = SimpleNamespace(directory=str(directory), problem="")
        self.entries = {}

    def get(self, key, _target):
        return (self.entries[key], "disk") if key in self.entries else (None, None)


def _wait_for(cache, key, into: dict) -> None:
    with BuildClaim(cache, key, "llvm") as claim:
        into["found"] = claim.found


def test_a_claimed_build_is_waited_for_and_a_dead_claimants_claim_is_taken_over(tmp_path):
    import socket
    import threading

    cache = _Cache(tmp_path)
    with BuildClaim(cache, "k", "llvm") as first:
        assert first.found == (None, None) and (tmp_path / f"k{CLAIM_SUFFIX}").exists()
        waiter = {}
        thread = threading.Thread(target=_wait_for, args=(cache, "k", waiter))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waits while the key is claimed and not built
        cache.entries["k"] = "built"
    thread.join(5)
    assert waiter["found"] == ("built", "disk") and not (tmp_path / f"k{CLAIM_SUFFIX}").exists()
    (tmp_path / f"j{CLAIM_SUFFIX}").write_text(f"{socket.gethostname()} 999999999")
    with BuildClaim(cache, "j", "llvm") as taken:  # no such process: the claim is stale
        assert taken.found == (None, None) and taken.path is not None


def _check_parity(records, case, graphs):
    """Losses and parameters as eager's on every rank, parameters equal across ranks, `graphs` TVM graphs
    (built or found in the memory cache) a rank, nothing on eager."""
    tolerance = TOLERANCE[case.optimizer]
    for record in records:
        assert len(record["losses"]) == case.steps
        assert max(abs(a - b) for a, b in zip(record["losses"], record["eager_losses"])) < tolerance
        assert largest_difference(record["parameters"], record["eager_parameters"]) < tolerance
        counters = record["counters"]
        assert counters["compiles"] + counters["cache_hits"] == graphs
        assert counters["eager_fallbacks"] == 0 and record["fallback_warnings"] == []
    for record in records[1:]:
        assert largest_difference(record["parameters"], records[0]["parameters"]) == 0
    assert records[0]["losses"] != records[1]["losses"]  # each rank trained on its own batches


def test_ddp_with_buckets_under_one_megabyte_trains_like_eager_ddp_and_builds_each_graph_once(tmp_path):
    """bucket_cap_mb=0.001: dynamo's DDP splitter cuts the tiny model's graph into one graph per bucket of
    at most 1048 bytes (5 of its 11 parameters' gradients in reverse order), each with a forward and a
    backward; without DDP's own first bucket size it fails before the backend runs. The ranks share a
    disk cache: each graph is built by one rank and loaded from the disk by the other."""
    case = CASES["ddp-small-buckets"]
    records = launch(case, env={"TVM_STITCH_CACHE_DIR": str(tmp_path)})
    _check_parity(records, case, graphs=10)
    counters = [r["counters"] for r in records]
    distinct = counters[0]["compiles"] + counters[0]["disk_hits"]  # what rank 0 did not find in its memory
    assert distinct >= 5
    assert sum(c["compiles"] for c in counters) == distinct  # each built once,
    assert sum(c["disk_hits"] for c in counters) == distinct  # and loaded by the rank that did not build it
    assert not list(tmp_path.glob("*.building"))


@pytest.mark.slow
def test_ddp_with_adamw_trains_like_eager_ddp():
    case = CASES["ddp"]
    _check_parity(launch(case), case, graphs=2)  # one bucket: the forward and the backward


@pytest.mark.slow
def test_fsdp2_with_compiled_blocks_trains_like_eager_fsdp2():
    case = CASES["fsdp2"]
    _check_parity(launch(case), case, graphs=4)  # each block's forward and backward


@pytest.mark.slow
def test_compiled_autograd_ddp_issues_all_reduces_while_the_backward_runs_on_tvm():
    """DDP's python reducer: the compiled-autograd backward holds an all-reduce per bucket (at most 524
    bytes: about one a parameter); each is issued as its gradient is computed, TVM parts between."""
    case = CASES["ddp-compiled-autograd"]
    records = launch(case)
    for record in records:
        names = [PART if name.startswith(PART) else name for name, _ in record["order"]]
        reduces, parts = names.count(ALL_REDUCE), names.count(PART)
        assert reduces >= 4 and parts == reduces + 1  # a part before each all-reduce, one reading the results
        first = names.index(ALL_REDUCE)
        assert first < len(names) - 1 - names[::-1].index(PART)  # issued before the backward's last TVM part
        assert names[first:].count(PART) == reduces  # and TVM computes on while it travels
    _check_parity(records, case, graphs=2 + parts)  # the forward, the backward's parts, the step's `detach`


@pytest.mark.slow
def test_compiled_autograd_ddp_trains_the_llama_block_like_eager_ddp():
    case = CASES["ddp-llama"]
    records = launch(case)
    graphs = records[0]["counters"]["compiles"] + records[0]["counters"]["cache_hits"]
    assert graphs >= 3  # the forward, the backward's parts before the (one-bucket) all-reduce and after it
    _check_parity(records, case, graphs=graphs)
