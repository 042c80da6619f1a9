"""Per-example clipping: the clipped sums of DP-SGD, two ways.

DP-SGD needs, for each microbatch (one example, or a group of consecutive
examples), its true gradient clipped to an L2 norm of `l2_norm_clip` over
every trainable variable, and the sum of those clipped gradients. Two
algorithms compute it, with the same result:

- `vectorized_clipped_sums`: each microbatch's gradient is computed on its
  own (vectorized by the backend: `tf.vectorized_map`, `jax.vmap`,
  `torch.func.vmap`), then clipped and summed (`accounting.clip_and_sum`).
  Any model; memory for one copy of the trainable weights per microbatch.
- `ghost_clipped_sums` (Li et al. 2022): one ordinary forward and backward
  pass records each supported layer's inputs and output gradients; each
  example's norm comes from those products (`custom_fit.ghost`), then the
  factor-weighted sums. No per-example gradient of those layers is ever
  held; a layer of another kind (a LayerNormalization, a custom layer
  whose weights are all its own) has its inputs and output gradients
  recorded too, and its per-example gradients computed for it alone
  (`_whole_terms`). One example per microbatch
  (`custom_fit.privacy._ghost_layers` says which models).

`DifferentialPrivacyMixin` chooses between them, adds the noise and
divides; these functions are the algorithms, given the model whose step
runs.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _keras_compat
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.privacy import _ghost_layers
from custom_fit.privacy import accounting
from custom_fit.privacy import ghost

__all__ = [
    "Clipped",
    "ghost_clipped_sums",
    "vectorized_clipped_sums",
]


@dataclasses.dataclass(frozen=True)
class Clipped:
    """The outcome of per-example clipping.

    Attributes:
        sums: The clipped gradients' sums, aligned with the variables,
            summed across replicas.
        norms: Float32 vector: each microbatch's gradient norm (before the
            clip).
        mask: `None`, or a boolean vector: the microbatches that count (a
            microbatch whose sample weights are all 0 does not).
    """

    sums: Gradients
    norms: Tensor
    mask: Any


def weighted_microbatches(weights: Any) -> Tensor:
    """Returns, per microbatch, whether any of its sample weights is not 0.

    Args:
        weights: The sample weights split into microbatches: a tensor, or
            a nested structure of them, whose first axis is the microbatch.

    Returns:
        A boolean vector.
    """
    flags = [
        ops.any(ops.reshape(ops.not_equal(w, 0), (ops.shape(w)[0], -1)), axis=1)
        for w in keras.tree.flatten(weights)
    ]
    return flags[0] if len(flags) == 1 else ops.all(ops.stack(flags), axis=0)


def vectorized_clipped_sums(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any,
    variables: list[Variable],
    optimizer: Optimizer,
    clip: Tensor,
    microbatches: int | None,
) -> tuple[Clipped, bool]:
    """Clips each microbatch's own gradient, then sums them.

    Args:
        model: The model whose step runs (its forward pass and losses).
        x: The batch's inputs.
        y: Its targets.
        sample_weight: Its sample weights, or `None`.
        variables: The variables to differentiate.
        optimizer: The optimizer of the update (its loss scale).
        clip: Float32 scalar, `l2_norm_clip`.
        microbatches: Integer, the number of microbatches, or `None` for
            one per example.

    Returns:
        A pair: the `Clipped` outcome, and whether the backend vectorized
        the microbatches' gradients (else it computed them one by one).
    """
    # With one example per microbatch the batch may be of any size.
    lead = (-1, 1) if microbatches is None else (microbatches, -1)

    def split(tensor: Any) -> Any:
        if tensor is None:
            return None
        tensor = ops.convert_to_tensor(tensor)
        if microbatches is not None and tensor.shape[0] is None:
            tensor = backend.current().divisible_first_axis(
                tensor,
                microbatches,
                "`num_microbatches` must divide the batch size. "
                f"Received: num_microbatches={microbatches} and a batch "
                "of the dataset whose size it does not divide (often "
                "the last, shorter batch). Batch the dataset with "
                "drop_remainder=True and a batch size that "
                "num_microbatches divides.",
            )
        return ops.reshape(tensor, lead + tuple(tensor.shape[1:]))

    inputs: tuple = (
        keras.tree.map_structure(split, x),
        keras.tree.map_structure(split, y),
    )
    if sample_weight is not None:
        inputs += (keras.tree.map_structure(split, sample_weight),)
    replicas = backend.current().replica_count()
    scale = pipeline.loss_scale(optimizer)

    def microbatch_loss(x: Any, y: Any, weights: Any = None) -> Tensor:
        y_pred = model.forward_pass(x, training=True)
        losses = _keras_compat.per_output_losses(model, y, y_pred, weights)
        # A microbatch's loss: the mean of its examples' losses (Keras
        # divides by the replica count under tf.distribute: undone).
        loss = _gradient_ops.add_all(list(losses.values())) * replicas
        for extra in model.losses:
            loss = loss + ops.cast(ops.sum(extra), loss.dtype)
        return optimizer.scale_loss(loss)

    per_microbatch, vectorized = backend.current().per_example_gradients(
        microbatch_loss, variables, inputs
    )
    if scale is not None:
        per_microbatch = [g / ops.cast(scale, g.dtype) for g in per_microbatch]
    # A microbatch whose sample weights are all 0 (a padding row of a
    # Poisson batch) contributes nothing, `model.losses` included.
    mask = None if sample_weight is None else weighted_microbatches(inputs[2])
    sums, norms = accounting.clip_and_sum(per_microbatch, clip, mask)
    return Clipped(
        backend.current().all_reduce_sum(sums), norms, mask
    ), vectorized


def ghost_clipped_sums(
    model: Any,
    loss_function: Callable[[], tuple[Tensor, Any]],
    batch: tuple[Any, Any, Any],
    variables: list[Variable],
    optimizer: Optimizer,
    clip: Tensor,
) -> tuple[Tensor, Any, Clipped] | str:
    """Clips each example's gradient from its layers' products, then sums.

    One forward pass over the batch records each supported layer's inputs
    and the gradients of the summed per-example losses with respect to its
    outputs; the per-example norms, then the factor-weighted sums, come
    from those (`custom_fit.ghost`).

    Args:
        model: The model whose step runs.
        loss_function: The step's loss function, `() -> (loss, y_pred)`.
        batch: `(x, y, sample_weight)` of the batch.
        variables: The variables to differentiate.
        optimizer: The optimizer of the update (its loss scale).
        clip: Float32 scalar, `l2_norm_clip`.

    Returns:
        `(loss, y_pred, clipped)`, or a string saying why ghost clipping
        does not apply to this model (the pass showed it: a layer adds a
        loss in its call, a loss mixes the examples, a layer is called on
        something else than the batch's examples).
    """
    x, y, weights = batch
    layers = _ghost_layers.layers_to_record(model, variables)
    regularized = [v for v in model.trainable_weights if v.regularizer]
    problems: list[str] = []
    calls: list[Any] = []

    def run(watch: Callable[[Any], Any]) -> tuple[Tensor, Any]:
        with _ghost_layers.recording(layers, watch) as recording:
            loss, y_pred = loss_function()
        recorded = recording.calls
        problems.extend(recording.problems)
        calls[:] = [layer for layer, _ in recorded]
        if len(model.losses) != len(regularized):
            problems.append(
                "a layer adds a loss in its call (add_loss), whose "
                "gradient is no product of a layer's inputs and output "
                "gradients"
            )
        # The sum of the examples' losses, each as the vectorized path has
        # it (Keras' `1 / replicas` scaling undone).
        total, problem = _keras_compat.summed_example_losses(
            model, y, y_pred, weights
        )
        if total is None:
            problems.append(problem)
            total = loss
        value = optimizer.scale_loss(total * backend.current().replica_count())
        # A whole layer's arguments leave the function as tensors only.
        replays[:] = [t for _, t in recorded]
        inputs = [
            t.tensors() if isinstance(t, _ghost_layers.Replay) else t
            for t in replays
        ]
        return value, (loss, y_pred, inputs)

    replays: list[Any] = []
    _, aux, gradients = backend.current().intermediate_gradients(run)
    loss, y_pred, inputs = aux
    inputs = [
        r.with_tensors(t) if isinstance(r, _ghost_layers.Replay) else t
        for r, t in zip(replays, inputs)
    ]
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    for layer, tensor in zip(calls, inputs):
        problems.append(
            _ghost_layers.call_problem(layer, tensor, first.shape[0])
        )
    problems = [p for p in problems if p]
    if problems:
        return problems[0]
    terms = {
        key: ghost.prepare(found)
        for key, found in _ghost_terms(
            calls, inputs, gradients, variables, optimizer
        ).items()
    }
    shared = _shared_gradients(variables, regularized)
    squares = ops.zeros(ops.shape(first)[:1], "float32")
    for v in variables:
        squares += ghost.squared_norms(terms[id(v)], shared.get(id(v)))
    # A NaN stays NaN (its example then counts zero); rounding below 0 does
    # not.
    norms = ops.sqrt(ops.where(squares < 0.0, 0.0, squares))
    mask = None if weights is None else weighted_microbatches(weights)
    factors = ghost.factors_of(
        ops.stop_gradient(accounting.clip_factors(norms, clip, mask))
    )
    sums = [
        ghost.weighted_sum(terms[id(v)], factors, v.shape, shared.get(id(v)))
        for v in variables
    ]
    return (
        loss,
        y_pred,
        Clipped(backend.current().all_reduce_sum(sums), norms, mask),
    )


def _ghost_terms(
    calls: list[Any],
    inputs: list[Any],
    gradients: list[Any],
    variables: list[Variable],
    optimizer: Optimizer,
) -> dict[int, list[ghost.Term]]:
    """Returns each variable's terms, from every recorded call."""
    scale = pipeline.loss_scale(optimizer)
    wanted = {id(v) for v in variables}
    terms: dict[int, list[ghost.Term]] = {key: [] for key in wanted}
    for layer, tensor, gradient in zip(calls, inputs, gradients):
        if scale is not None:
            gradient = gradient / ops.cast(scale, gradient.dtype)
        if _ghost_layers.is_whole(layer):
            found = _whole_terms(layer, tensor, gradient, wanted)
        else:
            found = _ghost_layers.terms(layer, tensor, gradient, wanted)
        for key, more in found.items():
            terms[key].extend(more)
    return terms


def _whole_terms(
    layer: Any,
    replay: _ghost_layers.Replay,
    gradient: Tensor,
    wanted: set[int],
) -> dict[int, list[ghost.Term]]:
    """Returns the per-example gradients of one call of a layer, alone.

    The layer runs again on each example's slice of its recorded
    arguments (vectorized by the backend, as the vectorized path runs the
    model), and each example's gradient of its weights is that of the
    example's output against the output gradient that came back to it.
    """
    variables = [v for v in layer.trainable_variables if id(v) in wanted]
    if not variables:
        return {}

    def one_example(*slices: Any) -> Tensor:
        *tensors, output_gradient = slices
        call = replay.with_tensors(tensors)
        outputs = layer(*call.args, **call.kwargs)
        return ops.sum(
            ops.cast(outputs, "float32") * ops.cast(output_gradient, "float32")
        )

    # Each example as a batch of one (the first axis is mapped over).
    inputs = tuple(
        ops.expand_dims(ops.stop_gradient(t), 1)
        for t in [*replay.tensors(), gradient]
    )
    gradients, _ = backend.current().per_example_gradients(
        one_example, variables, inputs
    )
    return {id(v): [ghost.PerExample(g)] for v, g in zip(variables, gradients)}


def _shared_gradients(
    variables: list[Variable], regularized: list[Variable]
) -> dict[int, Tensor]:
    """Returns the gradients of the weight regularizers (`model.losses`).

    Every example's loss includes them, so every example's gradient has
    this part.
    """
    wanted = {id(v) for v in variables}
    own = [v for v in regularized if id(v) in wanted]
    if not own:
        return {}

    def penalty() -> tuple[Tensor, None]:
        values = [ops.cast(ops.sum(v.regularizer(v)), "float32") for v in own]
        return _gradient_ops.add_all(values), None

    _, _, gradients = backend.current().value_and_grad(penalty, own)
    return {id(v): g for v, g in zip(own, gradients)}
