"""DDP and FSDP2 training with backend="tvm_stitch" in 2 processes (gloo on 127.0.0.1) against eager."""

import pytest

torch = pytest.importorskip("torch")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from tvm_stitch.tools.dist_parity import CASES, launch, largest_difference  # noqa: E402

PART, ALL_REDUCE = "tvm_stitch: part", "_c10d_functional::all_reduce"
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-4}


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
