"""OpenCL buffers with guard zones: a write past either end of a buffer is seen after the launch.

Each buffer is a sub-buffer in the middle of a larger allocation; the
zones before and after it are filled with a byte pattern and compared
after the kernels ran. The zone size is a multiple of the device's base
address alignment (a sub-buffer must start at one). Contents that no one
initialises (outputs, workspaces) are filled with 0xFF bytes (NaN for
floats), so an element the kernel forgot to write shows up as a mismatch.
Without guards (`guard=False`, for Oclgrind, which checks every access
against the buffer's own bounds), uninitialised buffers are left
uninitialised so that Oclgrind can report reads of them.
"""

from __future__ import annotations

import numpy as np
try:
    import pyopencl as cl
except ImportError:  # the test extra is not installed: device_for says so
    cl = None

from tvm_stitch.simt.simt_inputs import numpy_dtype

GUARD_BYTE = 0xA5
UNSET_BYTE = 0xFF
MIN_GUARD = 4096


class GuardedBuffer:
    """One kernel argument: `data` (initial contents, or None for uninitialised) of `shape` and `dtype`."""

    def __init__(self, ctx, name: str, dtype, shape: tuple, data: np.ndarray | None, guard: bool):
        self.name = name
        self.dtype = numpy_dtype(dtype)
        self.shape = tuple(shape)
        self.nbytes = max(1, int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize)
        flags = cl.mem_flags.READ_WRITE
        if not guard:
            self.guard = 0
            if data is None:
                self.parent = cl.Buffer(ctx, flags, self.nbytes)
            else:
                self.parent = cl.Buffer(ctx, flags | cl.mem_flags.COPY_HOST_PTR, hostbuf=_bytes(data, self.nbytes))
            self.buffer = self.parent
            return
        align = max(dev.mem_base_addr_align // 8 for dev in ctx.devices)
        self.guard = -(-max(MIN_GUARD, align) // align) * align
        tail = -(-self.nbytes // align) * align - self.nbytes + self.guard
        image = np.full(self.guard + self.nbytes + tail, GUARD_BYTE, np.uint8)
        body = _bytes(data, self.nbytes) if data is not None else np.full(self.nbytes, UNSET_BYTE, np.uint8)
        image[self.guard: self.guard + self.nbytes] = body
        self.image = image
        self.parent = cl.Buffer(ctx, flags | cl.mem_flags.COPY_HOST_PTR, hostbuf=image)
        self.buffer = self.parent.get_sub_region(self.guard, self.nbytes)

    def read(self, queue) -> tuple:
        """(contents as an array of `shape`, description of a guard-zone write or "")."""
        if not self.guard:
            out = np.empty(self.nbytes, np.uint8)
            cl.enqueue_copy(queue, out, self.parent)
            return _array(out, self.dtype, self.shape), ""
        image = np.empty_like(self.image)
        cl.enqueue_copy(queue, image, self.parent)
        before = np.flatnonzero(image[: self.guard] != GUARD_BYTE)
        after = np.flatnonzero(image[self.guard + self.nbytes:] != GUARD_BYTE)
        problem = ""
        if before.size:
            problem = f"{self.name}: written {self.guard - before[0]} bytes before its start"
        elif after.size:
            problem = f"{self.name}: written {after[-1] + 1} bytes past its end ({self.nbytes} bytes)"
        return _array(image[self.guard: self.guard + self.nbytes], self.dtype, self.shape), problem


def _bytes(data: np.ndarray, nbytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size == nbytes:
        return raw
    out = np.zeros(nbytes, np.uint8)
    out[: raw.size] = raw
    return out


def _array(raw: np.ndarray, dtype: np.dtype, shape: tuple) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return raw[: count * dtype.itemsize].view(dtype).reshape(shape).copy()
