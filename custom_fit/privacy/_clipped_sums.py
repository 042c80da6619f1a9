"""The private step's clipped sums: ghost or vectorized, and their figures.

`DifferentialPrivacyMixin.compute_gradients` chooses how a step clips
(`clipping_choice`: ghost norms where every trained layer allows, each
example's gradient otherwise), gets the sums of the clipped microbatch
gradients from `custom_fit.privacy.per_example`, reports the clipped
share (`dp_clipped_fraction`) and keeps the global microbatch count for
the noise's division; in a fit audited by a `CanaryAudit`, the canaries'
slot sums too (`custom_fit.privacy._canaries`).
"""

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.privacy import _canaries
from custom_fit.privacy import _ghost_layers
from custom_fit.privacy import _record
from custom_fit.privacy import per_example
from custom_fit.train_step_mixin import BatchLoss


def step_sums(
    model: Any,
    loss_function: BatchLoss,
    variables: Sequence[Variable],
    optimizer: Optimizer,
) -> tuple[Tensor, Any, Gradients]:
    """Returns a step's `(loss, y_pred, sums)`: ghost where it applies.

    Ghost clipping when `clipping_choice` says so and its pass confirms
    it; otherwise a forward pass for the logged loss and `y_pred`, and
    the vectorized per-example gradients. Variables Keras overwrites with
    their gradient (float8 state) get `None`.
    """
    weighted = [v for v in variables if not pipeline.is_overwritten(v)]
    found = None
    if clipping_choice(model, weighted)[0] == "ghost":
        found = ghost_sums(model, loss_function, weighted, optimizer)
    if found is None:
        loss, y_pred = loss_function()
        clipped = vectorized_sums(model, loss_function, weighted, optimizer)
    else:
        loss, y_pred, clipped = found
    sums = iter(clipped)
    gradients: Gradients = [
        None if pipeline.is_overwritten(v) else next(sums) for v in variables
    ]
    return loss, y_pred, gradients


def audit_slot_sums(model: Any, is_update: Tensor | None) -> Tensor | None:
    """The audit's clipped slot sums and canary rows of the update.

    With accumulation, those of the update's batches so far (kept in
    the audit's state until the update). `None` without an audit.
    """
    audit = _record.of(model).audit
    if audit is None:
        return None
    found = _model_state.state_of(model).local.audit_sums
    if is_update is not None:
        found = found + backend.current().read(audit.pending)
        audit.pending.assign(ops.where(is_update, ops.zeros_like(found), found))
    return found


def record_audit(
    model: Any,
    noisy: Tensor,
    rows: Tensor,
    is_update: Tensor | None,
) -> None:
    """Records the update's noisy slot sum in the audit's statistics."""
    statistics = _record.of(model).audit.statistics
    before = backend.current().read(statistics)
    after = _canaries.recorded(before, noisy, rows)
    if is_update is not None:
        after = ops.where(is_update, after, before)
    statistics.assign(after)


def vectorized_sums(
    model: Any,
    loss_function: BatchLoss,
    variables: list[Variable],
    optimizer: Optimizer,
) -> Gradients:
    """Returns the sums of the clipped microbatch gradients, vectorized.

    Summed across replicas (`per_example.vectorized_clipped_sums`, on the
    batch of `loss_function`); the number of microbatches of the global
    batch is kept for `finalize_gradients` (`local.dp_microbatches`).
    """
    x = loss_function.x
    microbatches = microbatch_count(model, x)
    clipped, vectorized = per_example.vectorized_clipped_sums(
        model,
        x,
        loss_function.y,
        loss_function.sample_weight,
        variables,
        optimizer,
        ops.cast(model.l2_norm_clip, "float32"),
        microbatches,
    )
    if not vectorized:
        model._warn_once(
            "dp_vectorization",
            "DifferentialPrivacyMixin: an op of the model cannot be "
            "vectorized over microbatches, so their gradients are "
            "computed one after another (slower, same result).",
        )
    note_clipping(model, x, clipped.norms, clipped.mask, microbatches)
    return clipped.sums


def note_clipping(
    model: Any, x: Any, norms: Tensor, mask: Any, microbatches: int | None
) -> None:
    """Reports the clipped share; keeps the global microbatch count."""
    clip = ops.cast(model.l2_norm_clip, "float32")
    changed = ops.logical_or(
        ops.greater(norms, clip), ops.logical_not(ops.isfinite(norms))
    )
    included = ops.ones_like(norms) if mask is None else mask
    included = ops.cast(included, "float32")
    # The global batch's share: both counts summed over replicas.
    clipped, total = backend.current().all_reduce_sum(
        [
            ops.sum(ops.cast(changed, "float32") * included),
            ops.sum(included),
        ]
    )
    model.report_metric(
        "dp_clipped_fraction", clipped / ops.maximum(total, 1.0)
    )
    state = _model_state.state_of(model)
    audit = _record.of(model).audit
    if audit is not None:
        # The canaries' rows, clipped as the examples' are: the global
        # batch's, summed over replicas as the clipped sums are.
        sums = _canaries.slot_sums(
            norms,
            mask,
            state.local.audit_rows,
            clip,
            audit.num_canaries,
        )
        state.local.audit_sums = backend.current().all_reduce_sum([sums])[0]
    # The global batch's count: this replica's, summed over replicas.
    summed_count = backend.current().summed_count
    if microbatches is None:
        count: Any = summed_count(_keras_compat.batch_size(x, "float32"))
    else:
        count = summed_count(float(microbatches))
    state.local.dp_microbatches = count


def clipped_variables(model: Any) -> list[Variable]:
    """The variables a step clips: the trainable ones, not float8."""
    return [
        v for v in model.trainable_variables if not pipeline.is_overwritten(v)
    ]


def clipping_choice(
    model: Any, variables: Sequence[Variable]
) -> tuple[str, str]:
    """Returns `(method, reason)`: how a step clips `variables`, and why.

    Raises:
        ValueError: For `clipping_method="ghost"` and a model it cannot
            handle, naming the layer.
    """
    if model.clipping_method == "vectorized":
        return "vectorized", "clipping_method='vectorized' was asked for"
    if model.num_microbatches is not None:
        return "vectorized", (
            "microbatches of several examples "
            f"(num_microbatches={model.num_microbatches}) are clipped as "
            "one, which ghost norms do not compute"
        )
    reason = _record.of(model).ghost_blocker
    reason = reason or _ghost_layers.blocker(
        model, variables, trust_code=model.clipping_method == "ghost"
    )
    if not reason:
        whole = _ghost_layers.whole_layers(model, variables)
        alone = ""
        if whole:
            named = ", ".join(
                f"{layer.name!r} ({type(layer).__name__})" for layer in whole
            )
            alone = (
                ", or to a layer whose per-example gradients are "
                f"computed for it alone: {named}"
            )
        return "ghost", (
            "every trained variable belongs to a layer whose per-example "
            f"norms come from its inputs and output gradients "
            f"({_ghost_layers.SUPPORTED_NAMES}, and their LoRA "
            f"weights){alone}"
        )
    if model.clipping_method == "ghost":
        raise ValueError(
            "`clipping_method='ghost'` cannot clip this model without "
            f"per-example gradients: {reason}. Received: "
            "clipping_method='ghost'. Use clipping_method='auto' (which "
            "then computes per-example gradients) or 'vectorized'."
        )
    return "vectorized", reason


def ghost_sums(
    model: Any,
    loss_function: BatchLoss,
    variables: list[Variable],
    optimizer: Optimizer,
) -> tuple[Tensor, Any, Gradients] | None:
    """Returns the loss, `y_pred` and clipped sums by ghost clipping.

    See `per_example.ghost_clipped_sums`. `None` when its pass shows
    that ghost clipping does not apply (remembered; the step then
    computes per-example gradients).
    """
    found = per_example.ghost_clipped_sums(
        model,
        loss_function,
        (loss_function.x, loss_function.y, loss_function.sample_weight),
        variables,
        optimizer,
        ops.cast(model.l2_norm_clip, "float32"),
    )
    if isinstance(found, str):
        if model.clipping_method == "ghost":
            raise ValueError(
                "`clipping_method='ghost'` cannot clip this model "
                f"without per-example gradients: {found}. "
                "Received: clipping_method='ghost'. Use "
                "clipping_method='auto' or 'vectorized'."
            )
        _record.of(model).ghost_blocker = found
        return None
    loss, y_pred, clipped = found
    note_clipping(model, loss_function.x, clipped.norms, clipped.mask, None)
    return loss, y_pred, clipped.sums


def microbatch_count(model: Any, x: Any) -> int | None:
    """Returns the number of microbatches; `None`: one per example.

    A `num_microbatches` that does not divide a batch of known size is
    refused here; a batch whose size is known only at run time (a
    dataset on TensorFlow) is checked by `split` when it arrives.
    """
    if model.num_microbatches is None:
        return None
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    batch_size = first.shape[0]
    count = model.num_microbatches
    if batch_size is not None and batch_size % count:
        raise ValueError(
            "`num_microbatches` must divide the batch size. Received: "
            f"num_microbatches={count} for a batch of {batch_size} "
            "examples (the batch size `fit` used, or its last, "
            "shorter batch). Pick a divisor of the batch size, and "
            "drop the remainder (a dataset batched with "
            "drop_remainder=True, or a number of examples divisible "
            "by the batch size)."
        )
    return count
