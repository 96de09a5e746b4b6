"""A dense layer's product with its leading axes merged on a CPU: ``nn.Dense(...,
dot_general=rows_dot_general)``.

A ``Dense`` on ``[batch, tokens, features]`` contracts ``features`` with its kernel; the kernel's
gradient then contracts the input's ``(batch, tokens)`` pair with the output's gradient. XLA:CPU
puts a product contracting two axes into its canonical form by copying the input into a
transposed ``[features, batch * tokens]`` array first: every layer, every step (ViT-B/16 at batch
8: 60 copies of ``f32[768, 1576]`` and 12 of ``f32[3072, 1576]`` a step). With the leading axes
merged beforehand (a free reshape of a row-major CPU array), the kernel's gradient contracts one
axis, which XLA:CPU's products read in place (benchmarks/results/dense_rows_cpu.md).

On a TPU the same reshape is a copy, the two minor axes being tiled and a token count rarely a
multiple of 8 (ViT-B/16's train step compiled for v5e needed 1.61 GiB of temporaries as it was,
2.11 GiB with the rows merged). The merge is therefore staged for the CPU alone with
``jax.lax.platform_dependent``, resolved when the program is lowered: a program traced on a CPU
and compiled for a TPU or a GPU keeps the product as written.
"""

from __future__ import annotations

import jax
from jax import lax

# Below this many input elements the copies cost less than the staged product costs to trace and
# lower (two branches, twice differentiated: 0.3-0.6 s more per ViT Ti/16 train step), and tiny
# models keep the plain product: a ViT on the digits ([64, 16, 64], 65,536 elements) gains
# nothing worth its start.
MERGE_MIN_ELEMENTS = 1 << 17


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` for ``nn.Dense`` (``lhs [..., in]`` by ``rhs [in, out]``), computed as
    one ``[rows, in]`` product on a CPU from ``MERGE_MIN_ELEMENTS`` input elements; any other
    contraction, and a smaller input, is passed on unchanged."""
    plain = lambda x, w: lax.dot_general(
        x, w, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    )
    dense = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (
        lhs.ndim <= 2
        or dimension_numbers != dense
        or rhs.ndim != 2
        # A symbolic size (an export for any batch): such programs are inference, whose forward
        # product reads its operands in place either way.
        or not all(isinstance(size, int) for size in lhs.shape)
        or lhs.size < MERGE_MIN_ELEMENTS
    ):
        return plain(lhs, rhs)

    def merged(x, w):
        rows = x.reshape(-1, x.shape[-1])
        product = lax.dot_general(
            rows, w, (((1,), (0,)), ((), ())), precision, preferred_element_type
        )
        return product.reshape(*x.shape[:-1], w.shape[1])

    return jax.lax.platform_dependent(lhs, rhs, cpu=merged, default=plain)
