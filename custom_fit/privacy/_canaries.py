"""Gradient-space canaries inside a private step (`auditing.CanaryAudit`).

A canary is an extra row of a batch, marked by its sample weight: `-(j +
1)` for canary `j` (the model's loss sees weight 0, so the row adds
nothing to the model's gradient). Its gradient is `BIG * l2_norm_clip`
times the `j`-th unit vector of the audit's slot, a coordinate the loss
never reads and no example touches: the canary's norm joins its row's
before the clip factor is taken, so a correct step adds exactly
`l2_norm_clip` to the slot for each row of canary `j`. The slot's clipped
sum is then noised with the model's gradients, in the same call, and the
noisy sum of each update is recorded here, in state variables (no host
read): the statistics `CanaryAudit.result` reads.

These are the step's pure functions and the state they update;
`DifferentialPrivacyMixin` calls them where its step clips and noises.
"""

from typing import Any

from keras import ops

from custom_fit._types import Tensor
from custom_fit.privacy import accounting

__all__ = [
    "BIG",
    "ROWS",
    "Slot",
    "decode",
    "recorded",
    "slot_sums",
]

# A canary's gradient norm, in units of the clip bound: well above it.
BIG = 10.0

# The rows of the statistics, one entry per canary each: the sum of its
# noisy slot values over the updates (its score); that sum over the
# updates it took part in, and their count; the sum of the squared values
# of the updates it took no part in (pure noise), and their count; the
# products of consecutive such values, and their count; and the last
# update's value (0 where it took part) and whether it was pure noise.
ROWS = (
    "score",
    "in_sum",
    "participations",
    "noise_squares",
    "noise_count",
    "lag_products",
    "lag_pairs",
    "previous",
    "previous_clean",
)


class Slot:
    """The state one audit keeps in one model's step.

    Its variables are the model's declared `_audit_buffers`
    (`DifferentialPrivacyMixin`), under the audit's own keys: a new audit
    starts from zero.

    Args:
        model: The audited `DifferentialPrivacyMixin` model.
        audit: The audit (a key of its variables).
        num_canaries: Integer, the canaries (the slot's length).

    Attributes:
        num_canaries: Integer.
        statistics: Float32 state variable of shape `(len(ROWS),
            num_canaries)`.
        pending: Float32 state variable of shape `(2, num_canaries)`: with
            gradient accumulation, the slot's clipped sums and the canaries'
            rows so far in the update.
    """

    def __init__(self, model: Any, audit: Any, num_canaries: int) -> None:
        self.num_canaries = num_canaries
        buffers = model._audit_buffers
        self.statistics = buffers.variable(
            (len(ROWS), num_canaries), key=(audit, "statistics")
        )
        self.pending = buffers.variable(
            (2, num_canaries), key=(audit, "pending")
        )


def decode(sample_weight: Any) -> tuple[Tensor, Tensor]:
    """Splits a batch's sample weights into canary indices and weights.

    Args:
        sample_weight: Float vector, one weight per row; `-(j + 1)` marks
            canary `j`.

    Returns:
        `(indices, weights)`: int32 vector, the canary of each row (-1 for
        an example or padding), and the weights with canary rows at 0.
    """
    weights = ops.convert_to_tensor(sample_weight)
    canary = ops.less(weights, 0)
    indices = ops.where(canary, ops.cast(ops.round(-weights), "int32") - 1, -1)
    return indices, ops.where(canary, ops.zeros_like(weights), weights)


def slot_sums(
    norms: Tensor,
    mask: Any,
    indices: Tensor,
    clip: Tensor,
    num_canaries: int,
) -> Tensor:
    """Returns the slot's clipped sum and each canary's rows, stacked.

    Each canary row's gradient is `BIG * clip` on its coordinate, plus
    what the rest of its row contributes to the clipped sum: nothing, for
    a row that counts for no example (`mask` false: its loss weight is 0),
    else its gradient of norm `norms`. The row is clipped as any example is
    (`accounting.clip_factors`).

    Args:
        norms: Float32 vector, each row's gradient norm before clipping.
        mask: Boolean vector (the rows that count as examples) or `None`.
        indices: Int32 vector, each row's canary (-1: none).
        clip: Float32 scalar, `l2_norm_clip`.
        num_canaries: Integer.

    Returns:
        A float32 `(2, num_canaries)` tensor: the slot's clipped sum, and
        the number of rows of each canary.
    """
    is_canary = ops.greater_equal(indices, 0)
    big = ops.cast(BIG, "float32") * clip
    norms = ops.cast(norms, "float32")
    if mask is not None:
        norms = ops.where(mask, norms, 0.0)
    joint = ops.sqrt(ops.where(is_canary, norms * norms + big * big, 0.0))
    factors = accounting.clip_factors(joint, clip, is_canary)
    # Rows of no canary go to one more segment, dropped.
    segments = ops.where(is_canary, indices, num_canaries)
    found = ops.segment_sum(
        ops.stack([factors * big, ops.cast(is_canary, "float32")], axis=1),
        segments,
        num_segments=num_canaries + 1,
    )
    return ops.transpose(found[:num_canaries])


def recorded(statistics: Tensor, noisy: Tensor, rows: Tensor) -> Tensor:
    """Returns the statistics after one update.

    Args:
        statistics: Float32 `(len(ROWS), num_canaries)`, before.
        noisy: Float32 vector, the slot's noisy sum of the update (before
            any division).
        rows: Float32 vector, each canary's rows in the update.

    Returns:
        The statistics after the update.
    """
    now = dict(zip(ROWS, ops.unstack(statistics, axis=0)))
    took_part = ops.cast(ops.greater(rows, 0), "float32")
    clean = 1.0 - took_part
    now["score"] = now["score"] + noisy
    now["in_sum"] = now["in_sum"] + noisy * took_part
    now["participations"] = now["participations"] + took_part
    now["noise_squares"] = now["noise_squares"] + noisy * noisy * clean
    now["noise_count"] = now["noise_count"] + clean
    now["lag_products"] = now["lag_products"] + noisy * clean * now["previous"]
    now["lag_pairs"] = now["lag_pairs"] + clean * now["previous_clean"]
    now["previous"] = noisy * clean
    now["previous_clean"] = clean
    return ops.stack([now[name] for name in ROWS])
