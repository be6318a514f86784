"""How the attention kernel reads Q, K or V from the tensor they are views of (plain data).

A model's Q, K and V are often views of a projection's output: GPT-2 splits
`c_attn`'s (batch, seq, 3 * heads * dim) output in three, reshapes each part
to (batch, seq, heads, dim) and permutes it to (batch, heads, seq, dim).
An `OperandView` records the source tensor's shape and the view steps from
it to the kernel's 4-d operand; the kernel maps each (b, h, s, d) it loads
back through the steps to an index of the source, so the views launch
nothing and the source is read in place. Steps:

  ("reshape", in_shape, out_shape)           row-major reshape
  ("permute", in_shape, axes)                out axis i is in axis axes[i]
  ("slice", in_shape, (axis, begin, stride)) out[.., i, ..] = in[.., begin + i * stride, ..]

A rotary embedding after the views (LLaMA's Q and K: x * cos + rotate_half(x)
* sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])) is recorded by
its cos and sin tables' shapes; the kernel reads the tables, passed after
the mask, per (position, dim) while staging the operand.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm_stitch.analysis.shape_dims import divides, is_static, product, same
from tvm_stitch.analysis.shape_dims import text as dim_text


@dataclass(frozen=True)
class OperandView:
    """The operand (4-d) as views of a tensor of shape `source`: `steps` in order from the source."""

    source: tuple
    steps: tuple = ()
    cos: tuple = ()  # a rotary embedding after the steps: its cos and sin tables' shapes ((.., seq, dim))
    sin: tuple = ()
    table_dtype: str = ""

    def table_index(self, table: str, b, row, d) -> list:
        """The index of the `table` ("cos" or "sin") element of batch `b`, position `row`, dim `d`."""
        shape = getattr(self, table)
        batch = b if len(shape) == 4 and not (is_static(shape[0]) and shape[0] == 1) else 0
        return [batch, 0, row, d][4 - len(shape):]

    @property
    def absorbed(self) -> bool:
        return bool(self.steps or self.cos)

    def describe(self) -> str:
        text = "x".join(map(dim_text, self.source))
        if self.steps:
            text += " through " + ", ".join(_step_text(s) for s in self.steps)
        return text + (", rotary embedding (cos, sin per position)" if self.cos else "")


def _step_text(step) -> str:
    op, _, params = step
    if op == "slice":
        axis, begin, stride = params
        return f"slice axis {axis} from {begin}" + (f" step {stride}" if stride != 1 else "")
    return f"{op} [{', '.join(dim_text(p) for p in params)}]"


def source_index(view: OperandView, index) -> list:
    """The source index the operand element `index` (ints or TIR expressions) is read from."""
    index = list(index)
    for op, in_shape, params in reversed(view.steps):
        if op == "permute":
            inner = [None] * len(in_shape)
            for out_axis, in_axis in enumerate(params):
                inner[in_axis] = index[out_axis]
            index = inner
        elif op == "slice":
            axis, begin, stride = params
            index = index[:axis] + [begin + index[axis] * stride] + index[axis + 1:]
        else:
            index = _reshaped(index, tuple(params), tuple(in_shape))
    return index


def _reshaped(index: list, out_shape: tuple, in_shape: tuple) -> list:
    """The index of `in_shape` holding the element at `index` of its row-major reshape to `out_shape`,
    axis group by axis group (reshape_groups)."""
    groups = reshape_groups(out_shape, in_shape)
    if groups is None:
        raise ValueError(f"reshape {in_shape} -> {out_shape}: no axis groups of equal sizes")
    result = []
    for (i0, i), (j0, j) in groups:
        linear = 0
        for axis in range(i0, i):
            linear = linear * out_shape[axis] + index[axis]
        group = []
        for axis in reversed(range(j0, j)):
            group.append(linear % in_shape[axis] if axis > j0 else linear)
            linear = linear // in_shape[axis]
        result += group[::-1]
    return result


def reshape_groups(out_shape: tuple, in_shape: tuple) -> list | None:
    """[((out axes from, to), (in axes from, to))]: consecutive axis groups of the two shapes whose
    sizes are provably equal (any such split maps a row-major reshape group by group), else None.
    A group grows on the side of the smaller size: the static side beside a symbolic one, the side
    whose size divides the other's where both are symbolic."""
    groups, i, j = [], 0, 0
    while i < len(out_shape) or j < len(in_shape):
        i0, j0, out_n, in_n = i, j, 1, 1
        if i < len(out_shape):
            out_n, i = out_shape[i], i + 1
        if j < len(in_shape):
            in_n, j = in_shape[j], j + 1
        while not same(out_n, in_n):
            grow_out = _smaller(out_n, in_n)
            if grow_out is None or (grow_out and i == len(out_shape)) or (not grow_out and j == len(in_shape)):
                return None
            if grow_out:
                out_n, i = product((out_n, out_shape[i])), i + 1
            else:
                in_n, j = product((in_n, in_shape[j])), j + 1
        groups.append(((i0, i), (j0, j)))
    return groups


def _smaller(a, b) -> bool | None:
    """True where `a` is the size to grow (the smaller), False where `b` is, None where unknown."""
    if is_static(a) and is_static(b):
        return a < b
    if is_static(a) != is_static(b):
        return is_static(a)
    if divides(a, b):
        return True
    return False if divides(b, a) else None
