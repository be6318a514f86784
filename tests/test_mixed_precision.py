"""One row of the mixed-precision table (benchmarks/mixed_precision_table.py) at test size: GPT-2's block
stack forward in bfloat16, both builds priced whole for sm_90 (tools/mixed_precision.py)."""

import pytest

from tvm_stitch.tools.mixed_precision import BOUNDS, bound_mix, price_step, tensor_core_gemms

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gpt2_bfloat16_forward():
    return price_step("gpt2", "forward", "bfloat16", {"kind": "cuda", "arch": "sm_90"}, size="test")


def test_every_half_precision_gemm_is_priced_on_tensor_cores(gpt2_bfloat16_forward):
    """Stitched: every GEMM's arithmetic on a tensor-core unit; TVM's default runs bfloat16 GEMMs on FMA."""
    gemms, on_tc = tensor_core_gemms(gpt2_bfloat16_forward.stitched)
    assert gemms and on_tc == gemms
    default_gemms, default_on_tc = tensor_core_gemms(gpt2_bfloat16_forward.default)
    assert default_gemms and default_on_tc == []


def test_the_stitched_step_is_modeled_below_the_default(gpt2_bfloat16_forward):
    step = gpt2_bfloat16_forward
    assert step.stitched.launches < step.default.launches
    assert 0 < step.stitched.us < step.default.us and step.ratio() > 1


def test_the_bound_mix_counts_every_launch(gpt2_bfloat16_forward):
    for priced in (gpt2_bfloat16_forward.default, gpt2_bfloat16_forward.stitched):
        mix = bound_mix(priced)
        assert sum(mix.values()) == priced.launches and set(mix) <= set(BOUNDS)
