"""The gradient figures of one update, computed once and shared.

An update needs the norms of its gradients several times over: the guard
asks whether they are finite and (with the spike options) their global
norm, global clipping divides by that norm, inspection reports it per
layer and after clipping. Each would be a full pass over every gradient.
Here the per-variable sums of squares of a list of gradients are computed
once (`Figures.squares`, one fused primitive of the backend adapter) and
every consumer reads them:

- the global norm is the square root of their sum, a layer's norm that of
  its members' sum;
- the gradients are finite exactly when that sum is: a NaN or an infinite
  entry makes its square, hence the sum, non-finite. The converse fails
  only when finite entries overflow when squared (above about 1.8e19 in
  float32); then, and only then, the entries are checked one by one;
- a transform that knows its output's figures says so (`register`): global
  clipping multiplies every gradient by one factor, so the clipped
  gradients' squares are the input's times the factor squared, and their
  finiteness that of the input and the factor. A user's transform does
  the same through `TrainStepMixin.scale_gradients`; one that makes new
  tensors otherwise makes the consumers after it take a second pass.

Figures are found by the identity of the gradient tensors (a traced step
passes the same tensor objects from hook to hook), in pages kept per
model and per thread (MirroredStrategy traces each replica in a thread of
its own) for the duration of one update (`open_book`).
"""

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _model_state
from custom_fit import backend
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import ModelBase
from custom_fit._types import Scalar
from custom_fit._types import Tensor


class Figures:
    """The sums of squares of one list of gradients, made when first read.

    Args:
        gradients: List of tensors, sparse gradients or `None`.
        squares: Optional callable returning the float32 vector of the sums
            of squares of the non-`None` gradients, in order, when they
            derive from known figures (called when first read).
        finite: Optional callable returning whether they are finite (a
            boolean scalar tensor), likewise.
        norm: Optional callable returning their global norm, likewise.
    """

    def __init__(
        self,
        gradients: Sequence[Gradient],
        squares: Callable[[], Tensor] | None = None,
        finite: Callable[[], Tensor] | None = None,
        norm: Callable[[], Tensor] | None = None,
    ) -> None:
        self.gradients = list(gradients)
        # Computed when first read, from these when given (derived figures).
        self._squares: Tensor | None = None
        self._finite: Tensor | None = None
        self._norm: Tensor | None = None
        self._derive_squares = squares
        self._derive_finite = finite
        self._derive_norm = norm

    @property
    def present(self) -> list[Any]:
        """The non-`None` gradients, in order."""
        return [g for g in self.gradients if g is not None]

    @property
    def squares(self) -> Tensor:
        """Float32 vector: the sum of squares of each non-`None` gradient."""
        if self._squares is None and self._derive_squares is not None:
            self._squares = self._derive_squares()
        if self._squares is None:
            present = [_gradient_ops.deduplicate(g) for g in self.present]
            if not present:
                self._squares = ops.zeros((0,), "float32")
            else:
                self._squares = backend.current().squared_sums(present)
        return self._squares

    @property
    def total(self) -> Tensor:
        """Float32 scalar: the sum of squares of every entry."""
        return ops.sum(self.squares)

    @property
    def norm(self) -> Tensor:
        """Float32 scalar: the global L2 norm."""
        if self._norm is None:
            if self._derive_norm is not None:
                self._norm = self._derive_norm()
            else:
                self._norm = ops.sqrt(self.total)
        return self._norm

    @property
    def finite(self) -> Tensor:
        """Boolean scalar: whether every entry is finite (exactly)."""
        if self._finite is None and self._derive_finite is not None:
            self._finite = self._derive_finite()
        if self._finite is None:
            present = self.present
            if not present:
                self._finite = ops.convert_to_tensor(True)
            else:
                self._finite = ops.cond(
                    ops.isfinite(self.total),
                    lambda: ops.convert_to_tensor(True),
                    lambda: _entries_finite(present),
                )
        return self._finite

    def group_squares(
        self, groups: Sequence[Hashable], order: Sequence[Hashable]
    ) -> Tensor:
        """Returns the sum of squares of each group, in `order`.

        One segment sum (not a product with a 0/1 matrix, whose zeros
        would turn one infinite square into NaN for every group): one op,
        where a sum per group would be two per group on an eager backend.

        Args:
            groups: List aligned with the gradients (`None` included): the
                group of each gradient.
            order: The groups to report.

        Returns:
            A float32 vector of `len(order)` sums (0 for an empty group).
        """
        keys = [key for g, key in zip(self.gradients, groups) if g is not None]
        segments = _segments(tuple(order), tuple(keys))
        sums = backend.current().group_sums(
            self.squares, segments, len(order) + 1
        )
        return sums[: len(order)]

    def scaled(
        self,
        gradients: Sequence[Gradient],
        factor: Tensor,
        at_most_one: bool = True,
    ) -> "Figures":
        """Returns the figures of `gradients`, this list times `factor`.

        Args:
            gradients: The scaled list (`None` where this one has `None`).
            factor: Float32 scalar tensor, the common factor.
            at_most_one: Whether `|factor| <= 1` (clipping): the product is
                then finite when these and the factor are. Otherwise its
                finiteness is that of the derived squares (a finite sum
                proves every entry finite; else each entry is read).

        The derived figures are computed when first read.

        Returns:
            `Figures` whose squares are these times `factor ** 2`.
        """
        finite = None
        if at_most_one:
            finite = lambda: ops.logical_and(  # noqa: E731
                self.finite, ops.isfinite(factor)
            )
        return Figures(
            gradients,
            # Derived when read (no consumer may ask: clipping alone).
            squares=lambda: self.squares * ops.square(factor),
            finite=finite,
            norm=lambda: self.norm * ops.abs(factor),
        )


@functools.lru_cache(maxsize=64)
def _segments(
    order: tuple[Hashable, ...], keys: tuple[Hashable, ...]
) -> np.ndarray:
    """The group index of each gradient (`len(order)` for none)."""
    row = {key: index for index, key in enumerate(order)}
    return np.asarray([row.get(key, len(order)) for key in keys], "int32")


def _entries_finite(gradients: Sequence[Any]) -> Tensor:
    """Returns whether every entry of the (non-`None`) gradients is finite."""
    flags = [_gradient_ops.is_finite(g) for g in gradients]
    return flags[0] if len(flags) == 1 else ops.all(ops.stack(flags))


def _key(gradients: Sequence[Gradient]) -> tuple[int, ...]:
    """The identity of a list of gradients: its tensors, `None`s included."""
    return tuple(0 if g is None else id(g) for g in gradients)


def _pages(model: Any) -> dict[tuple[int, ...], Figures] | None:
    """The figures of the running update of `model` in this thread."""
    return getattr(_model_state.state_of(model).local, "figures", None)


@contextlib.contextmanager
def open_book(model: Any) -> Iterator[None]:
    """Keeps the figures computed inside the block for one update of `model`.

    Outside such a block `of` still works, without sharing.
    """
    local = _model_state.state_of(model).local
    outer = getattr(local, "figures", None)
    local.figures = {}
    try:
        yield
    finally:
        local.figures = outer


def of(model: Any, gradients: Sequence[Gradient]) -> Figures:
    """Returns the figures of `gradients`, shared within the update.

    Args:
        model: The model whose update runs.
        gradients: A list of gradients.

    Returns:
        The `Figures` registered for these tensors in this update, or new
        ones (registered for the rest of the update).
    """
    pages = _pages(model)
    key = _key(gradients)
    if pages is None:
        return Figures(gradients)
    found = pages.get(key)
    if found is None:
        found = pages[key] = Figures(gradients)
    return found


def register(model: Any, figures: Figures) -> None:
    """Registers figures that a transform knows for its output."""
    pages = _pages(model)
    if pages is not None:
        pages[_key(figures.gradients)] = figures


class SharedFigures(ModelBase):
    """The shared gradient figures, as a model's hooks ask for them.

    A base of `TrainStepMixin` (not for direct use): its methods are the
    model's.
    """

    def gradient_global_norm(self, gradients: Gradients) -> Tensor:
        """Returns the global norm of `gradients`, shared within the update.

        Call it from a hook (`transform_gradients`): within one update the
        squared norms of a list of gradients are computed once and shared
        by every reader (global clipping, the guard of `skip_nonfinite`,
        inspection's per-layer norms, and your transform), so asking for
        the norm of the gradients your hook received costs no second pass
        over them. Outside a step it computes the norm.

        Args:
            gradients: List of gradients (`None` entries ignored), as a hook
                receives them.

        Returns:
            A float32 scalar tensor: the square root of the sum of every
            entry's square.
        """
        return of(self, gradients).norm

    def scale_gradients(
        self, gradients: Gradients, factor: Scalar
    ) -> Gradients:
        """Returns `gradients` times one `factor`, with their figures known.

        For a transform that multiplies every gradient by the same scalar
        (a normalization, a clipping of your own): the hooks after it
        (the guard, inspection) read the result's norm from the input's
        and the factor, instead of a second pass over every gradient, as
        they would for gradients multiplied by `ops.multiply`. (Float32
        gradients; in another dtype, such as float16 under mixed
        precision, the product's rounding differs from the derived figures
        and the readers after it take their own pass.)

        Args:
            gradients: List of gradients (`None` kept; sparse ones keep
                their indices).
            factor: Python float or scalar tensor.

        Returns:
            The scaled list, aligned with `gradients`.

        Raises:
            ValueError: If `factor` is not a scalar.
        """
        if len(ops.shape(factor)) != 0:
            raise ValueError(
                "scale_gradients multiplies every gradient by one scalar. "
                f"Received: a factor of shape {tuple(ops.shape(factor))}. "
                "Pass a float or a scalar tensor."
            )
        present = [g for g in gradients if g is not None]
        if not present:
            return list(gradients)
        figures = of(self, gradients)
        factor = ops.cast(factor, "float32")
        scaled = iter(backend.current().scaled(present, factor))
        result = [None if g is None else next(scaled) for g in gradients]
        if all(
            keras.backend.standardize_dtype(g.dtype) in ("float32", "float64")
            for g in present
        ):
            # Float32 products match the derived figures; any factor.
            register(
                self, figures.scaled(result, factor, at_most_one=False)
            )
        return result
