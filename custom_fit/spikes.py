"""Gradient-spike rules as pure functions on the global gradient norm.

A step whose true global gradient norm is far above what training has
seen is usually a bad batch or the start of a divergence; large-model
trainers skip it. Two rules, either or both:

- an absolute bound: the norm exceeds `bound`;
- a relative one: the norm exceeds `ratio` times the running average of
  the norms of the updates applied so far (an exponential moving average,
  bias-corrected), once `warmup_steps` updates have been applied.

```python
average, count = custom_fit.spikes.updated_average(
    average, count, norm, decay=0.99
)
spike = custom_fit.spikes.is_spike(
    norm, bound=None, ratio=5.0, average=average, count=count,
    warmup_steps=20, decay=0.99,
)
```
"""

from typing import Any

from keras import ops

from custom_fit._types import Tensor


def corrected_average(average: Any, count: Any, decay: float) -> Tensor:
    """Returns the bias-corrected exponential moving average.

    Args:
        average: Float scalar, the raw average (started at 0).
        count: Integer scalar, the number of values averaged.
        decay: Float in (0, 1), the average's decay.

    Returns:
        `average / (1 - decay ** count)`, or 0 when nothing was averaged.
    """
    count = ops.cast(count, "float32")
    weight = 1.0 - ops.power(decay, count)
    return ops.where(count > 0, average / ops.maximum(weight, 1e-30), 0.0)


def updated_average(
    average: Any, count: Any, value: Any, decay: float
) -> tuple[Tensor, Tensor]:
    """Adds `value` to an exponential moving average.

    Args:
        average: Float scalar, the raw average (started at 0).
        count: Integer scalar, the number of values averaged.
        value: Float scalar, the new value.
        decay: Float in (0, 1).

    Returns:
        The new `(average, count)`.

    Example:

    ```python
    >>> average, count = updated_average(0.0, 0, 2.0, decay=0.9)
    >>> float(corrected_average(average, count, 0.9))
    2.0
    ```
    """
    value = ops.cast(value, "float32")
    return decay * average + (1.0 - decay) * value, count + 1


def is_spike(
    norm: Any,
    bound: Any = None,
    ratio: Any = None,
    average: Any = None,
    count: Any = None,
    warmup_steps: int = 0,
    decay: float = 0.99,
) -> Tensor:
    """Returns whether a global gradient norm is a spike.

    Args:
        norm: Float scalar, the step's true global gradient norm.
        bound: Float (or scalar tensor) or `None`: a spike is a norm above
            it.
        ratio: Float (or scalar tensor) greater than 1, or `None`: a spike
            is a norm above `ratio` times the running average, once
            `count >= warmup_steps`.
        average: Float scalar, the raw running average (with `ratio`).
        count: Integer scalar, the number of norms averaged (with `ratio`).
        warmup_steps: Integer, the number of averaged norms before the
            relative rule applies.
        decay: Float, the running average's decay.

    Returns:
        A boolean scalar tensor (false for a non-finite norm: that is the
        non-finite guard's to judge).
    """
    norm = ops.cast(norm, "float32")
    spike = ops.convert_to_tensor(False)
    if bound is not None:
        spike = ops.logical_or(spike, norm > ops.cast(bound, "float32"))
    if ratio is not None:
        mean = corrected_average(average, count, decay)
        warm = ops.cast(count, "int32") >= warmup_steps
        above = norm > ops.cast(ratio, "float32") * mean
        spike = ops.logical_or(spike, ops.logical_and(warm, above))
    return ops.logical_and(spike, ops.isfinite(norm))
