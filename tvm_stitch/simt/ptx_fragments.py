"""Which matrix element each lane of a warp holds, as the PTX ISA documents it.

Each function maps (lane, index of the element in the lane's fragment) to
(row, column) of the matrix. The SIMT checker's emulated tensor-core
instructions (simt/mma_emulation.py) are generated from these functions, so
the OpenCL build places and takes every fragment element where the hardware
does; a kernel that assumes another layout gets other values.

PTX ISA (8.x), "Matrix fragments for mma.m16n8k16 with floating point
type" (.f16 / .bf16 multiplicands, .f16 / .f32 accumulators):
groupID = laneid >> 2, threadID_in_group = laneid % 4;
A (16 x 16, row-major): a0..a7, row groupID for a0, a1, a4, a5 and
groupID + 8 for a2, a3, a6, a7; column threadID_in_group * 2 + (i & 1),
plus 8 for a4..a7.
B (16 x 8, k x n): b0..b3, row threadID_in_group * 2 + (i & 1), plus 8 for
b2, b3; column groupID.
C and D (16 x 8): c0..c3, row groupID for c0, c1 and groupID + 8 for c2,
c3; column threadID_in_group * 2 + (i & 1).

PTX ISA, "Warp-level matrix load instruction: ldmatrix" (.m8n8, .b16,
.x1 / .x2 / .x4, optional .trans): threads 0-7 give the row addresses of
the first 8 x 8 matrix, 8-15 of the second, 16-23 of the third, 24-31 of
the fourth; each thread receives, per matrix, the pair of elements of row
laneid / 4, columns 2 * (laneid % 4) and the next one (with .trans, of the
matrix as transposed), in its destination register of that matrix. Read as
32-bit elements (a float32 tile, 8 rows of 4), the lane receives element
(laneid / 4, laneid % 4) of each matrix (`ldmatrix_element_32`).

PTX ISA, "Matrix fragments for mma.m16n8k8" (.tf32 multiplicands, .f32
accumulators): A (16 x 8): a0..a3, row groupID, plus 8 for a1 and a3;
column threadID_in_group, plus 4 for a2 and a3. B (8 x 8, k x n): b0, b1,
row threadID_in_group, plus 4 for b1; column groupID. C and D as for
m16n8k16.
"""

from __future__ import annotations

WARP = 32
MMA_M, MMA_N, MMA_K = 16, 8, 16
LDMATRIX_ROWS = 8  # an .m8n8 matrix: 8 rows of 8 16-bit elements
LDMATRIX_COLUMNS_32 = 4  # ... or of 4 32-bit elements
TF32_K = 8  # depth of mma.m16n8k8


def group_of(lane: int) -> tuple:
    """(groupID, threadID_in_group) of a lane."""
    return lane >> 2, lane % 4


def mma_a(lane: int, i: int) -> tuple:
    """(row, column) of element a<i> (0..7) of `lane` in the 16 x 16 A of mma.m16n8k16."""
    group, thread = group_of(lane)
    return group + 8 * ((i // 2) % 2), thread * 2 + (i & 1) + 8 * (i // 4)


def mma_b(lane: int, i: int) -> tuple:
    """(row k, column n) of element b<i> (0..3) of `lane` in the 16 x 8 B of mma.m16n8k16."""
    group, thread = group_of(lane)
    return thread * 2 + (i & 1) + 8 * (i // 2), group


def mma_c(lane: int, i: int) -> tuple:
    """(row, column) of element c<i> / d<i> (0..3) of `lane` in the 16 x 8 C and D of mma.m16n8k16."""
    group, thread = group_of(lane)
    return group + 8 * (i // 2), thread * 2 + (i & 1)


def ldmatrix_row_given(lane: int) -> tuple:
    """(matrix, row) whose address `lane` gives to ldmatrix."""
    return lane // LDMATRIX_ROWS, lane % LDMATRIX_ROWS


def ldmatrix_element(lane: int, j: int) -> tuple:
    """(row, column) of the j-th (0, 1) element `lane` receives of each 8 x 8 matrix (before .trans)."""
    return lane // 4, 2 * (lane % 4) + j


def ldmatrix_element_32(lane: int) -> tuple:
    """(row, column) of the 32-bit element `lane` receives of each 8 x 4 matrix (ldmatrix .b16 without .trans)."""
    return lane // 4, lane % 4


def mma_tf32_a(lane: int, i: int) -> tuple:
    """(row, column) of element a<i> (0..3) of `lane` in the 16 x 8 A of mma.m16n8k8 .tf32."""
    group, thread = group_of(lane)
    return group + 8 * (i % 2), thread + 4 * (i // 2)


def mma_tf32_b(lane: int, i: int) -> tuple:
    """(row k, column n) of element b<i> (0, 1) of `lane` in the 8 x 8 B of mma.m16n8k8 .tf32."""
    group, thread = group_of(lane)
    return thread + 4 * i, group
