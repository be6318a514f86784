"""A half-precision GEMM as the importer emits a product: float32 accumulation, cast to the dtype.

Not a suite graph (the suite is memory-intensive): the GPU check kit times it
(`gpu_kit.GEMMS`), TVM's default build (dlight's Matmul: wmma for float16,
the SIMT cores for bfloat16) against the stitched one (tensor cores for both,
schedules/cuda/tensor_core_matmul.py). bfloat16 arrays are ml_dtypes'
(apache-tvm's own dependency), imported only for a bfloat16 entry.
"""

DESCRIPTION = "GEMM (rows x depth) @ (depth x cols), float32 accumulation, cast to the dtype"
DTYPES = ("bfloat16", "float16")


def relax_graph(rx, dtype, d):
    params = [rx.tensor("a", (d["rows"], d["depth"]), dtype), rx.tensor("b", (d["depth"], d["cols"]), dtype)]

    def body(bb, a, b):
        product = bb.emit(rx.op.matmul(a, b, out_dtype="float32"))
        return bb.emit(rx.op.astype(product, dtype))

    return rx.function(params, body)


def _array_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


def inputs(rng, dtype, d):
    """a and b with entries of N(0, 1) / depth^(1/4): products of order one."""
    scale = d["depth"] ** -0.25
    return [(rng.standard_normal(shape) * scale).astype(_array_dtype(dtype))
            for shape in ((d["rows"], d["depth"]), (d["depth"], d["cols"]))]


def numpy_reference(a, b):
    return a @ b


def torch_graph(a, b):
    return (a.float() @ b.float()).to(a.dtype)
