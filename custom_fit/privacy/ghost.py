"""Ghost clipping: per-example gradient norms without per-example gradients.

DP-SGD clips the gradient of every example. For the layers whose weight
gradient is a product of what the layer saw and what came back to it (a
Dense kernel's gradient is `inputs^T @ output_gradient`), the norm of
each example's gradient follows from the layer's inputs and output
gradients alone, without ever forming the per-example gradient (Goodfellow
2015, "Efficient per-example gradient computations"; Li et al. 2022, "Large
Language Models Can Be Strong Differentially Private Learners", whose name
"ghost clipping" this takes). The clipped sum is then the factor-weighted
contraction of the same tensors. These are the pure parts: the mixin
records the tensors (`DifferentialPrivacyMixin`, `clipping_method`).

An example's gradient of one weight is described by a term:

- `Product(x, g, x_spec, g_spec, weight_spec)`: example `i`'s gradient is
  `einsum(f"{x_spec},{g_spec}->{weight_spec}", x[i], g[i])`. A Dense
  kernel is `Product(inputs, output_gradient, "tc", "to", "co")` (`t`:
  positions of a sequence, if any); its bias `Product(None, ...)`, a sum of
  `g` alone; a convolution's kernel is a `Product` of image patches; LoRA
  weights are `Product`s too (`lora_products`).
- `Rows(indices, g, rows)`: example `i`'s gradient is the table of `rows`
  rows whose row `k` is the sum of `g[i, t]` over the positions `t` where
  `indices[i, t] == k` (an Embedding table).
- `PerExample(gradients)`: example `i`'s gradient is `gradients[i]`, the
  gradient itself, for a weight whose gradient is none of these products
  (a LayerNormalization's scale, a custom layer's weight), computed for
  its layer alone.

The squared norm of a `Product` is computed in whichever form costs less,
chosen from the static shapes: the Gram form `sum_{t,s} (x_t . x_s)(g_t .
g_s)` (`T^2 (P + Q)` per example, `T` positions, `P` and `Q` the sizes the
weight contracts with) or the direct form, the gradient itself (`T P Q`,
one weight at a time). A gradient `M` that every example shares (that of
`model.losses`' weight regularizers) enters as `||G_i + M||^2 = ||G_i||^2
+ 2 <G_i, M> + ||M||^2`.

```python
norms = ops.sqrt(ghost.squared_norms([ghost.Product(x, g, "c", "o", "co")]))
```
"""

import dataclasses
import itertools
import string
from collections.abc import Sequence
from typing import Any

from keras import ops

from custom_fit._types import Tensor

__all__ = [
    "PerExample",
    "Product",
    "Rows",
    "conv_patches",
    "lora_products",
    "squared_norms",
    "weighted_sum",
]


# Einsum letters: the example axis, the second position axis of a Gram
# form, and the free letters that specs are written with.
_EXAMPLE = "Z"
_LETTERS = "".join(c for c in string.ascii_letters if c != _EXAMPLE)


@dataclasses.dataclass(frozen=True)
class Product:
    """A weight's per-example gradient as a contraction of two tensors.

    Example `i`'s gradient is `einsum(f"{x_spec},{g_spec}->{weight_spec}",
    x[i], g[i])`: letters of `x_spec` and `g_spec` that are not in
    `weight_spec` are summed over (positions of a sequence, of an image).

    Attributes:
        x: Tensor whose first axis is the example, or `None` for ones: the
            gradient is then a sum of `g` (a bias).
        g: Tensor whose first axis is the example.
        x_spec: String, one einsum letter per axis of `x` after the first
            (`""` when `x` is `None`).
        g_spec: String, one letter per axis of `g` after the first.
        weight_spec: String, one letter per axis of the weight (of its
            shape without axes of size 1), each in `x_spec` or `g_spec`.
    """

    x: Tensor | None
    g: Tensor
    x_spec: str
    g_spec: str
    weight_spec: str


@dataclasses.dataclass(frozen=True)
class Rows:
    """A table's per-example gradient: rows of `g` added at `indices`.

    Example `i`'s gradient is the `(rows, g.shape[-1])` table whose row `k`
    is the sum of `g[i, ..., :]` over the positions where `indices[i, ...]`
    equals `k` (an Embedding's gradient).

    Attributes:
        indices: Integer tensor whose first axis is the example.
        g: Tensor of shape `indices.shape + (width,)`.
        rows: Integer, the number of rows of the table.
    """

    indices: Tensor
    g: Tensor
    rows: int


@dataclasses.dataclass(frozen=True)
class PerExample:
    """A weight's per-example gradients, held whole.

    Example `i`'s gradient is `gradients[i]`. For the weights of layers
    whose gradient is no product of their inputs and output gradients,
    computed for their layer alone from what it saw and what came back
    to it (`custom_fit.per_example`): memory for one copy of those weights
    per example and call of the layer, not of the whole model.

    Attributes:
        gradients: Tensor of shape `(examples, *weight.shape)`.
    """

    gradients: Tensor


Term = Product | Rows | PerExample


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One weight's terms, joined and laid out once (`prepare`).

    `squared_norms` and `weighted_sum` take it in place of the terms, so
    that a step which needs both lays the tensors out once.

    Attributes:
        product: The weight's `Product` terms as one canonical term, or
            `None`.
        rows: The weight's `Rows` terms as one, or `None`.
        whole: The sum of the weight's `PerExample` gradients (float32),
            or `None`.
    """

    product: Any
    rows: Rows | None
    whole: Any = None


def prepare(terms: "Sequence[Term] | Prepared") -> Prepared:
    """Returns one weight's terms joined and laid out for both uses.

    Args:
        terms: List of `Product`, of `Rows` or of `PerExample` (one kind),
            describing the same weight (or an already `Prepared` one,
            returned as is).

    Returns:
        A `Prepared`.
    """
    if isinstance(terms, Prepared):
        return terms
    if terms and isinstance(terms[0], PerExample):
        whole = [
            ops.cast(t.gradients, "float32")
            for t in terms
            if isinstance(t, PerExample)
        ]
        total = whole[0]
        for more in whole[1:]:
            total = total + more
        return Prepared(None, None, total)
    if terms and isinstance(terms[0], Rows):
        return Prepared(None, _joined_rows(terms))
    products = [_canonical(t) for t in terms if isinstance(t, Product)]
    return Prepared(_joined(products) if products else None, None)


@dataclasses.dataclass(frozen=True)
class _Canonical:
    """A `Product` as `x[b, t, h, p]` and `g[b, t, h, q]`.

    Example `b`'s gradient is `G[h, p, q] = sum_t x[b, t, h, p] g[b, t, h,
    q]`; `order` names the weight's letters in `(h, p, q)` order, `sizes`
    the size of each letter.
    """

    x: Tensor | None  # None: ones of width 1 (a bias)
    g: Tensor
    positions: int | None
    order: str
    weight_spec: str
    sizes: dict[str, int]


def squared_norms(
    terms: "Sequence[Term] | Prepared", shared: Tensor | None = None
) -> Any:
    """Returns each example's squared gradient norm of one weight.

    The example's gradient is the sum of its gradients in `terms` (one
    per call of a layer used several times) plus `shared`.

    Args:
        terms: List of `Product`, of `Rows` or of `PerExample` (one
            kind), describing the same weight, or what `prepare` made of
            them.
        shared: Tensor of the weight's shape or `None`: a gradient that
            every example has (that of weight regularizers).

    Returns:
        A float32 vector, one entry per example (a scalar, `||shared||^2`,
        when `terms` is empty).

    Example:

    ```python
    >>> x = np.array([[1.0, 2.0]]); g = np.array([[3.0]])
    >>> float(squared_norms([Product(x, g, "c", "o", "co")])[0])
    45.0
    ```
    """
    ready = prepare(terms)
    shared = None if shared is None else ops.cast(shared, "float32")
    if ready.whole is not None:
        squares = _whole_squared_norms(ready.whole, shared)
    elif ready.rows is not None:
        squares = _rows_squared_norms(ready.rows, shared)
    elif ready.product is not None:
        squares = _product_squared_norms(ready.product, shared)
    else:
        constant = 0.0 if shared is None else ops.sum(ops.square(shared))
        return ops.convert_to_tensor(constant, "float32")
    if shared is None:
        return squares
    return squares + ops.sum(ops.square(shared))


@dataclasses.dataclass(frozen=True)
class Factors:
    """Per-example factors laid out once for every weight (`factors_of`).

    Attributes:
        values: Float32 vector, one factor per example.
        keep: Boolean `[examples, 1, 1, 1]`: the factor is not 0.
        column: Float32 `[examples, 1, 1, 1]`: the factors.
    """

    values: Tensor
    keep: Tensor
    column: Tensor


def factors_of(factors: "Tensor | Factors") -> Factors:
    """Returns `factors` laid out once for `weighted_sum` of each weight.

    Args:
        factors: Float vector, one factor per example (or `Factors`,
            returned as is).

    Returns:
        A `Factors`.
    """
    if isinstance(factors, Factors):
        return factors
    values = ops.cast(factors, "float32")
    column = ops.reshape(values, (-1, 1, 1, 1))
    return Factors(values, ops.not_equal(column, 0.0), column)


def weighted_sum(
    terms: "Sequence[Term] | Prepared",
    factors: "Tensor | Factors",
    shape: Sequence[int],
    shared: Tensor | None = None,
) -> Tensor:
    """Returns `sum_i factors[i] * (gradient of example i)` of one weight.

    An example whose factor is 0 contributes exactly zero, even when its
    tensors hold NaN (its rows are replaced by zeros first: `0 * NaN` is
    NaN).

    Args:
        terms: As in `squared_norms`.
        factors: Float vector, one factor per example, or what
            `factors_of` made of it (laid out once for every weight).
        shape: The weight's shape.
        shared: As in `squared_norms`: added `sum(factors)` times.

    Returns:
        A float32 tensor of `shape`.

    Example:

    ```python
    >>> x = np.array([[1.0, 2.0], [5.0, 5.0]]); g = np.array([[3.0], [1.0]])
    >>> weighted_sum([Product(x, g, "c", "o", "co")], np.array([1.0, 0.0]),
    ...              (2, 1))
    array([[3.], [6.]], dtype=float32)
    ```
    """
    ready = prepare(terms)
    laid = factors_of(factors)
    if ready.whole is not None:
        total = _whole_weighted_sum(ready.whole, laid.values, shape)
    elif ready.rows is not None:
        total = _rows_weighted_sum(ready.rows, laid.values, shape)
    elif ready.product is not None:
        total = _product_weighted_sum(ready.product, laid, shape)
    else:
        total = ops.zeros(tuple(shape), "float32")
    if shared is not None:
        total = total + ops.sum(laid.values) * ops.cast(shared, "float32")
    return total


def letters(count: int, avoid: str = "") -> str:
    """Returns `count` einsum letters for specs, none of them in `avoid`.

    Args:
        count: Integer, how many.
        avoid: String of letters already taken.

    Returns:
        A string of distinct letters (never the one this module uses for
        the example axis).

    Example:

    ```python
    >>> letters(3, avoid="b")
    'acd'
    ```
    """
    return "".join(c for c in _LETTERS if c not in avoid)[:count]


def lora_products(
    kernel: Product, lora_a: Tensor, lora_b: Tensor, scale: float
) -> tuple[Product, Product]:
    """Returns the terms of LoRA's two weights from the merged kernel's.

    Keras' LoRA (`layer.enable_lora(rank)`) computes with the kernel
    `W + scale * matmul(A, B)`, `A` of the kernel's shape but its last axis
    replaced by the rank, `B` of shape `(rank, last axis)`. Given the
    merged kernel's term, example `i`'s gradients are `dA = scale * G_i
    B^T` and `dB = scale * A^T G_i` (contracting every axis but the last),
    each again a `Product` whose tensors are `x` or `g` contracted with `B`
    or `A`.

    Args:
        kernel: The `Product` of the merged kernel (its `x` not `None`).
        lora_a: The values of `A`.
        lora_b: The values of `B`.
        scale: Float, `lora_alpha / lora_rank`.

    Returns:
        The terms `(term_of_a, term_of_b)`.

    Example:

    ```python
    term_a, term_b = lora_products(
        Product(inputs, output_gradient, "c", "o", "co"), a, b, 2.0)
    ```
    """
    xs, gs, ws = kernel.x_spec, kernel.g_spec, kernel.weight_spec
    last, rest = ws[-1], ws[:-1]
    rank = letters(1, avoid=xs + gs + ws)
    b = ops.cast(lora_b, "float32") * scale
    a = ops.cast(lora_a, "float32") * scale
    x = ops.cast(kernel.x, "float32")
    g = ops.cast(kernel.g, "float32")
    z = _EXAMPLE
    if last in gs and last not in xs:
        spec = gs.replace(last, rank)
        g_a = ops.einsum(f"{z}{gs},{rank}{last}->{z}{spec}", g, b)
        term_a = Product(x, g_a, xs, spec, rest + rank)
    elif last in xs and last not in gs:
        spec = xs.replace(last, rank)
        x_a = ops.einsum(f"{z}{xs},{rank}{last}->{z}{spec}", x, b)
        term_a = Product(x_a, g, spec, gs, rest + rank)
    else:  # an axis of the weight that both sides keep: summed for A
        g_a = ops.einsum(f"{z}{gs},{rank}{last}->{z}{gs}{rank}", g, b)
        term_a = Product(x, g_a, xs, gs + rank, rest + rank)
    contracted = {c for c in rest if c in xs and c not in gs}
    kept = "".join(c for c in xs if c not in contracted)
    kept += "".join(c for c in rest if c not in xs) + rank
    x_b = ops.einsum(f"{z}{xs},{rest}{rank}->{z}{kept}", x, a)
    return term_a, Product(x_b, g, kept, gs, rank + last)


def conv_patches(
    inputs: Tensor,
    kernel_size: Sequence[int],
    strides: Sequence[int],
    padding: str,
    dilation_rate: Sequence[int],
) -> Tensor:
    """Returns the patches a convolution multiplies with its kernel.

    With these patches, a convolution is a Dense layer applied at each
    output position: `conv(inputs, kernel)[b, o...] = einsum("...kc,kcf",
    patches[b, o...], kernel)`.

    Args:
        inputs: Tensor `(batch, *spatial, channels)` (channels last), the
            spatial sizes known.
        kernel_size: Tuple of integers, one per spatial axis.
        strides: Tuple of integers.
        padding: `"valid"`, `"same"` (as TensorFlow and XLA pad: the odd
            pixel after) or `"causal"` (one spatial axis, padded before).
        dilation_rate: Tuple of integers.

    Returns:
        A tensor `(batch, *output_spatial, *kernel_size, channels)`.

    Example:

    ```python
    >>> conv_patches(np.arange(4.0).reshape(1, 4, 1), (2,), (1,), "valid",
    ...              (1,)).shape
    (1, 3, 2, 1)
    ```
    """
    rank = len(kernel_size)
    pads, outputs = [[0, 0]], []
    for size, k, s, d in zip(
        inputs.shape[1 : 1 + rank], kernel_size, strides, dilation_rate
    ):
        span = (k - 1) * d + 1
        before = after = 0
        if padding == "same":
            out = -(-size // s)
            total = max((out - 1) * s + span - size, 0)
            before, after = total // 2, total - total // 2
        elif padding == "causal":
            before = span - 1
        out = (size + before + after - span) // s + 1
        pads.append([before, after])
        outputs.append(out)
    padded = ops.pad(inputs, pads + [[0, 0]])
    pieces = []
    for offsets in itertools.product(*(range(k) for k in kernel_size)):
        index = [slice(None)]
        for offset, s, d, out in zip(offsets, strides, dilation_rate, outputs):
            index.append(slice(offset * d, offset * d + (out - 1) * s + 1, s))
        pieces.append(padded[tuple(index)])
    stacked = ops.stack(pieces, axis=1 + rank)
    return ops.reshape(
        stacked,
        (-1, *outputs, *kernel_size, inputs.shape[-1]),
    )


# Products.


def _canonical(term: Product) -> _Canonical:
    """Returns `term` as `x[b, t, h, p]`, `g[b, t, h, q]` (float32)."""
    xs, gs, ws = term.x_spec, term.g_spec, term.weight_spec
    g = ops.cast(term.g, "float32")
    x = None if term.x is None else ops.cast(term.x, "float32")
    sizes = _sizes(gs, g)
    if x is not None:
        for letter, size in _sizes(xs, x).items():
            if sizes.get(letter) is None:
                sizes[letter] = size
    free = "".join(c for c in xs if c in gs and c not in ws)
    shared = "".join(c for c in ws if c in xs and c in gs)
    left = "".join(c for c in ws if c in xs and c not in gs)
    right = "".join(c for c in ws if c in gs and c not in xs)
    positions = _product(sizes[c] for c in free)
    blocks = _product(sizes[c] for c in shared)
    g = _laid_out(g, gs, free + shared + right)
    g = _flat(g, positions, blocks, _product(sizes[c] for c in right))
    if x is not None:
        x = _laid_out(x, xs, free + shared + left)
        x = _flat(x, positions, blocks, _product(sizes[c] for c in left))
    return _Canonical(x, g, positions, shared + left + right, ws, sizes)


def _laid_out(tensor: Tensor, spec: str, order: str) -> Tensor:
    """Returns `tensor` (axes: the example, then `spec`) in `order`."""
    if spec == order:
        return tensor
    return ops.einsum(f"{_EXAMPLE}{spec}->{_EXAMPLE}{order}", tensor)


def _flat(tensor: Tensor, positions: int | None, *widths: Any) -> Tensor:
    """Reshapes to `(examples, positions, *widths)`, keeping static sizes."""
    target = (positions, *widths)
    if None not in target and tuple(tensor.shape[1:]) == target:
        return tensor
    if positions is None:
        return ops.reshape(tensor, (ops.shape(tensor)[0], -1, *widths))
    return ops.reshape(tensor, (-1, positions, *widths))


def _sizes(spec: str, tensor: Tensor) -> dict[str, Any]:
    """Returns the static size of each letter of `spec` (`None`: unknown)."""
    return dict(zip(spec, tensor.shape[1:]))


def _product(values: Any) -> int | None:
    """Returns the product of integers; `None` if one is unknown."""
    result = 1
    for value in values:
        if value is None:
            return None
        result *= int(value)
    return result


def _joined(parts: list[_Canonical]) -> _Canonical:
    """Joins the canonical terms of one weight along the positions."""
    if len(parts) == 1:
        return parts[0]
    counts = [p.positions for p in parts]
    known = None if None in counts else sum(c for c in counts if c)
    return dataclasses.replace(
        parts[0],
        x=ops.concatenate([_x(p) for p in parts], axis=1),
        g=ops.concatenate([p.g for p in parts], axis=1),
        positions=known,
    )


def _x(term: _Canonical) -> Tensor:
    """The term's `x`, ones of width 1 for a bias."""
    if term.x is None:
        return ops.ones_like(term.g[..., :1])
    return term.x


def _width(term: _Canonical) -> int:
    """The size `p` of the term's `x[b, t, h, p]`."""
    return 1 if term.x is None else int(term.x.shape[3])


def _uses_gram(term: _Canonical) -> bool:
    """Whether the Gram form costs less than the gradient itself.

    Per example and block: `T^2 (P + Q)` against `T P Q`; unknown `T`
    (a sequence of any length): the gradient, whose cost does not grow
    with the square of it.
    """
    positions = term.positions
    left = 1 if term.x is None else term.x.shape[-1]
    right = term.g.shape[-1]
    if positions is None:
        return False
    return positions * (left + right) < left * right


def _product_squared_norms(term: _Canonical, shared: Tensor | None) -> Any:
    """Returns `||G_i||^2 (+ 2 <G_i, shared>)` of a canonical term.

    With one position (a Dense layer on vectors) each block of the
    gradient is an outer product, `||x g^T||^2 = ||x||^2 ||g||^2`.
    """
    if term.positions == 1 and shared is None:
        g_squares = ops.sum(ops.square(term.g), axis=3)
        if term.x is not None:
            g_squares = g_squares * ops.sum(ops.square(term.x), axis=3)
        return ops.sum(g_squares, axis=(1, 2))
    x = _x(term)
    if _uses_gram(term):
        xx = ops.einsum("Ztha,Zsha->Zhts", x, x)
        gg = ops.einsum("Zthb,Zshb->Zhts", term.g, term.g)
        squares = ops.sum(xx * gg, axis=(1, 2, 3))
        if shared is None:
            return squares
        projected = ops.einsum("Ztha,hab->Zthb", x, _blocks(term, shared))
        return squares + 2.0 * ops.sum(projected * term.g, axis=(1, 2, 3))
    gradients = ops.einsum("Ztha,Zthb->Zhab", x, term.g)
    squares = ops.sum(ops.square(gradients), axis=(1, 2, 3))
    if shared is None:
        return squares
    inner = ops.sum(gradients * _blocks(term, shared), axis=(1, 2, 3))
    return squares + 2.0 * inner


def _blocks(term: _Canonical, weight: Tensor) -> Tensor:
    """Returns a weight-shaped tensor as `[h, p, q]` of the term."""
    view = ops.reshape(weight, [term.sizes[c] for c in term.weight_spec])
    view = ops.einsum(f"{term.weight_spec}->{term.order}", view)
    return ops.reshape(view, (term.g.shape[2], _width(term), -1))


def _product_weighted_sum(
    term: _Canonical, factors: Factors, shape: Sequence[int]
) -> Tensor:
    """Returns `sum_i factors[i] G_i` of a canonical term, as the weight."""
    keep = factors.keep
    g = ops.where(keep, term.g, 0.0) * factors.column
    if term.x is None:  # a sum of g: the weight is [h, 1, q]
        total = ops.sum(g, axis=(0, 1))
    else:
        x = ops.where(keep, term.x, 0.0)
        total = ops.einsum("Ztha,Zthb->hab", x, g)
    if term.order != term.weight_spec:
        total = ops.reshape(total, [term.sizes[c] for c in term.order])
        total = ops.einsum(f"{term.order}->{term.weight_spec}", total)
    if tuple(total.shape) == tuple(shape):
        return total
    return ops.reshape(total, tuple(shape))


# Rows.


def _joined_rows(terms: Sequence[Term]) -> Rows:
    """Returns the `Rows` terms of one table as one, positions flattened."""
    indices, gradients = [], []
    rows = [term for term in terms if isinstance(term, Rows)]
    for term in rows:
        positions = _product(term.indices.shape[1:])
        indices.append(_flat(term.indices, positions))
        gradients.append(
            _flat(ops.cast(term.g, "float32"), positions, term.g.shape[-1])
        )
    if len(rows) == 1:
        return Rows(indices[0], gradients[0], rows[0].rows)
    return Rows(
        ops.concatenate(indices, axis=1),
        ops.concatenate(gradients, axis=1),
        rows[0].rows,
    )


def _rows_squared_norms(term: Rows, shared: Tensor | None) -> Any:
    """Returns `||G_i||^2 (+ 2 <G_i, shared>)` of a table's rows.

    Pairs of positions with the same index (`T^2 Q`), or, for sequences
    longer than the table has rows, the gradient itself (`T R Q`).
    """
    indices = ops.cast(term.indices, "int32")
    positions = term.indices.shape[1]
    if positions is not None and positions <= term.rows:
        same = ops.cast(
            ops.equal(indices[:, :, None], indices[:, None, :]), "float32"
        )
        products = ops.einsum("Ztq,Zsq->Zts", term.g, term.g)
        squares = ops.sum(same * products, axis=(1, 2))
    else:
        table = ops.einsum(
            "Ztr,Ztq->Zrq", ops.one_hot(indices, term.rows), term.g
        )
        squares = ops.sum(ops.square(table), axis=(1, 2))
    if shared is None:
        return squares
    picked = ops.take(shared, indices, axis=0)
    return squares + 2.0 * ops.sum(picked * term.g, axis=(1, 2))


def _rows_weighted_sum(
    term: Rows, factors: Tensor, shape: Sequence[int]
) -> Tensor:
    """Returns `sum_i factors[i] G_i` of a table's rows."""
    keep = ops.reshape(ops.not_equal(factors, 0.0), (-1, 1, 1))
    g = ops.where(keep, term.g, 0.0) * ops.reshape(factors, (-1, 1, 1))
    width = term.g.shape[-1]
    total = ops.segment_sum(
        ops.reshape(g, (-1, width)),
        ops.reshape(ops.cast(term.indices, "int32"), (-1,)),
        num_segments=term.rows,
    )
    return ops.reshape(total, tuple(shape))


# Per-example gradients held whole.


def _whole_squared_norms(gradients: Tensor, shared: Tensor | None) -> Any:
    """Returns `||G_i||^2 (+ 2 <G_i, shared>)` of gradients held whole."""
    axes = tuple(range(1, len(gradients.shape)))
    squares = ops.sum(ops.square(gradients), axis=axes)
    if shared is None:
        return squares
    return squares + 2.0 * ops.sum(gradients * shared, axis=axes)


def _whole_weighted_sum(
    gradients: Tensor, factors: Tensor, shape: Sequence[int]
) -> Tensor:
    """Returns `sum_i factors[i] G_i` of gradients held whole."""
    column = ops.reshape(factors, (-1,) + (1,) * (len(gradients.shape) - 1))
    kept = ops.where(ops.not_equal(column, 0.0), gradients, 0.0)
    return ops.reshape(ops.sum(kept * column, axis=0), tuple(shape))
