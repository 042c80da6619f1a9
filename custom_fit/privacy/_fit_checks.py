"""What a private `fit` checks before its first step, and keys as it starts.

`DifferentialPrivacyMixin.fit` calls these on `fit`'s arguments: the run
the accountant will count (the sampling, the batch size, the data set
size, over several processes the global ones), the accumulation windows
in which an example could count twice, the model tried on a first batch
(state that follows the data; examples mixed), a loss or hook the private
gradient would leave out, and the earlier fit's open window. Each
refusal names the setting and the fix. `ResumedRun` keys a run with given
seeds by where it starts.
"""

import hashlib
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _fit_data
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import backend
from custom_fit import callbacks as callbacks_module
from custom_fit._types import Optimizer
from custom_fit.privacy import _independence
from custom_fit.privacy import _record
from custom_fit.privacy import accounting


def accounted_run(
    model: Any, arguments: dict[str, Any]
) -> tuple[accounting.TrainingRun, list[Any]]:
    """Checks the run `fit`'s `arguments` make against the accountant.

    Returns the global run (`accounting.TrainingRun`: over several
    processes, the processes' together; a `PrivacyBudget`'s stated
    sampling where the data does not say) and the fit's `PrivacyBudget`s.
    Flattens nested callback lists in `arguments` as Keras would. Warns
    when the run goes past calibrated noise's steps.

    Raises:
        ValueError: When the run would not be the one accounted.
    """
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        listed = callbacks.callbacks
    else:
        # Nested lists too, as `keras.Model.fit` takes them.
        listed = list(keras.tree.flatten(callbacks or []))
        if callbacks is not None:
            arguments["callbacks"] = listed
    budgets = [
        callback
        for callback in listed
        if isinstance(callback, callbacks_module.PrivacyBudget)
    ]
    accumulation = model.gradient_accumulation_steps or 1
    run = training_run(arguments, accumulation)
    check_run_seen_over_processes(
        arguments.get("x"),
        run,
        bool(budgets)
        or isinstance(model.noise_multiplier, accounting.CalibratedNoise),
    )
    run = across_processes(run)
    run = accounting.stated_run(run, budgets, accumulation)
    check_windows(arguments, accumulation, run.sampling)
    check_padded_shares(arguments.get("x"))
    updates = int(ops.convert_to_numpy(model.optimizer.iterations))
    warning = accounting.check_run(
        model.noise_multiplier,
        model.expected_batch_size,
        run,
        max(model.private_steps, updates),
        model.num_microbatches,
        accumulation,
    )
    for callback in budgets:
        accounting.check_accounted_run(
            callback.num_examples, callback.batch_size * accumulation, run
        )
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=3)
    return run, budgets


def training_run(
    arguments: dict[str, Any], accumulation: int
) -> accounting.TrainingRun:
    """Returns how `fit`, called with `arguments`, draws its batches.

    With `accumulation` batches per update, the mechanism runs once per
    logical batch of `accumulation` batches.
    """
    x = arguments.get("x")
    epochs = arguments.get("epochs", 1) - arguments.get("initial_epoch", 0)
    per_epoch = arguments.get("steps_per_epoch")
    sampling = getattr(x, "sampling", None)
    if sampling in accounting.SAMPLINGS:
        batch_size = getattr(x, "batch_size", None)
        num_examples = getattr(x, "num_examples", None)
        if per_epoch is None and hasattr(x, "__len__"):
            per_epoch = len(x)  # type: ignore[arg-type]
        described = f"a {type(x).__name__} of {sampling!r} batches"
    elif _fit_data.is_arrays(x):
        sampling = "shuffle"
        num_examples = _fit_data.array_examples(
            x, arguments.get("validation_split")
        )
        batch_size, batches = _fit_data.array_batches(
            num_examples, arguments.get("batch_size")
        )
        if per_epoch is None:
            per_epoch = batches
        described = f"arrays in batches of batch_size={batch_size}"
    else:
        sampling = batch_size = num_examples = None
        described = f"data of type {type(x).__name__}"
    steps = None if per_epoch is None else max(epochs, 0) * per_epoch
    if accumulation > 1:
        batch_size = None if batch_size is None else batch_size * accumulation
        steps = None if steps is None else steps // accumulation
        described += f", {accumulation} per update"
    return accounting.TrainingRun(
        sampling, batch_size, num_examples, steps, described
    )


def across_processes(run: accounting.TrainingRun) -> accounting.TrainingRun:
    """The global run of this process' `run`, over several processes.

    Where each process feeds `fit` its own share (`torch.distributed`; JAX
    under a `keras.distribution`), shuffled arrays are accounted as the
    global batch (the local batch times the processes) over all the
    shards' examples. A `PoissonSampler` is the whole data set in every
    process, each feeding its share of the same draw (checked by `fit`):
    its run is already the global one.
    """
    processes, share = backend.current().data_shards()
    if processes == 1 or run.sampling in (None, "poisson"):
        return run
    # Processes that feed the same share (JAX: the same batch positions)
    # hold the same examples: each share counts once.
    gathered = backend.current().gather_from_processes(
        [share, int(run.num_examples or 0)]
    )
    examples = {int(row[0]): int(row[1]) for row in gathered}
    return accounting.TrainingRun(
        run.sampling,
        None if run.batch_size is None else run.batch_size * processes,
        sum(examples.values()),
        run.steps,
        f"{run.described} in each of {processes} processes",
    )


def check_run_seen_over_processes(
    x: Any, run: accounting.TrainingRun, accounted: bool
) -> None:
    """Refuses accounting over processes that custom_fit cannot check.

    Where several processes each feed `fit` (`torch.distributed`; JAX
    under a `keras.distribution`), the accountant needs the global run:
    custom_fit derives it from arrays (each process' share) and a
    `PoissonSampler` (one draw shared). For data it cannot see into, a
    `PrivacyBudget`'s stated `batch_size` could be one process' batch or
    the global one, and a batch half the global one counts half the
    passes: refused. So is a `PyDataset` that Keras deals to the
    processes itself (Keras 3.16's `auto_shard_dataset`): each process'
    `len` is not its steps. One process: nothing to refuse.

    Args:
        x: `fit`'s data.
        run: This process' `TrainingRun`.
        accounted: Whether a `PrivacyBudget` or calibrated noise accounts
            the run.

    Raises:
        ValueError: Naming the data and the fix.
    """
    if backend.current().data_shards()[0] == 1 or not accounted:
        return
    fix = (
        "Feed each process its share of arrays (`x[rank::world]`) or a "
        "custom_fit.sampling.PoissonSampler of the whole data in every "
        "process, with `auto_shard_dataset = False` on JAX."
    )
    if _fit_data.keras_shards() > 1 and isinstance(x, keras.utils.PyDataset):
        raise ValueError(
            "A private fit over several processes cannot be accounted when "
            "Keras deals a PyDataset's batches to the processes (each "
            "process' batch count is not its steps). Received: a "
            f"{type(x).__name__} with auto_shard_dataset=True. {fix}"
        )
    if run.sampling is None:
        raise ValueError(
            "A private fit over several processes is accounted on the "
            "global batches, and custom_fit cannot tell them from "
            f"{run.described}: a PrivacyBudget's batch_size could be one "
            "process' batch, and the accountant would count too few "
            f"passes. Received: {run.described}. {fix}"
        )


def _strictest_over_processes(found: _independence.Probe) -> Any:
    """The strictest verdict of every process' check (one collective).

    Where several processes each feed their share, each tried its own
    first batch: all must take the same path (ghost clipping or not) and
    refuse together, or the others would wait in a collective.
    """
    if backend.current().data_shards()[0] == 1:
        return found
    flags = [
        int(bool(found.leaks)),
        int(bool(found.mixing)),
        int(found.checked),
    ]
    rows = backend.current().gather_from_processes(flags)
    leaks = found.leaks or (
        "in another process (each process tried its first batch)"
        if rows[:, 0].max()
        else ""
    )
    mixing = found.mixing or (
        "the check of another process' first batch found the examples mixed"
        if rows[:, 1].max()
        else ""
    )
    return _independence.Probe(
        checked=bool(rows[:, 2].min()), mixing=mixing, leaks=leaks
    )


def _library_class(cls: type) -> bool:
    """Whether `cls` is Keras' or custom_fit's (not a user's)."""
    module = cls.__module__ or ""
    return module.split(".")[0] in ("keras", "custom_fit")


def check_padded_shares(x: Any) -> None:
    """Refuses a distributed sampler that repeats examples to even shares.

    PyTorch's `DistributedSampler` with `drop_last=False` pads the shares
    with repeated examples, which then enter a pass twice.

    Raises:
        ValueError: Naming the fix.
    """
    sampler = getattr(x, "sampler", None)
    replicas = getattr(sampler, "num_replicas", 1)
    size = len(getattr(sampler, "dataset", ()) or ())
    if (
        getattr(sampler, "drop_last", True) is False
        and isinstance(replicas, int)
        and replicas > 1
        and size % replicas
    ):
        raise ValueError(
            "A distributed sampler that pads its shares repeats examples "
            f"({size} examples over {replicas} processes): a repeated "
            "example is in a pass twice, and the accountant counts one. "
            "Received: drop_last=False. Make it with drop_last=True."
        )


def check_windows(
    arguments: dict[str, Any], accumulation: int, stated: str | None = None
) -> None:
    """Refuses accumulation windows in which an example could count twice.

    With `accumulation` batches per update, each update must hold one
    Poisson draw (a sampler that serves each draw as that many batches,
    fed in order), or batches of one shuffled pass (passes, and epochs of
    `steps_per_epoch`, of a whole number of updates).

    Raises:
        ValueError: Naming the data's figures and the fix.
    """
    x: Any = arguments.get("x")
    per_epoch = arguments.get("steps_per_epoch")
    sampling = getattr(x, "sampling", None) or stated
    name = f"gradient_accumulation_steps={accumulation}"
    split = getattr(x, "gradient_accumulation_steps", 1)
    if sampling == "poisson" and split != accumulation:
        raise ValueError(
            f"With {name} on the model, an update's {accumulation} "
            "batch(es) must be one Poisson draw, as the accountant counts it "
            f"(one draw at {accumulation} times the sampler's rate): a draw "
            "per batch could put an example in one update several times, "
            "and a draw dealt over several updates is no Poisson draw per "
            f"update. Received: a {type(x).__name__} that serves each draw "
            f"as {split} batch(es). Pass the same number to the sampler: "
            f"PoissonSampler(x, y, batch_size=..., {name})."
        )
    if accumulation == 1:
        return
    if sampling == "poisson":
        if per_epoch is not None and per_epoch % len(x):
            raise ValueError(
                f"With {name} on Poisson draws, an epoch must be whole "
                "passes of the sampler's batches: Keras keeps its iterator "
                "across shorter epochs and reads ahead, so one update could "
                "take parts of two draws (of two epochs), in which an "
                f"example could count twice. Received: steps_per_epoch="
                f"{per_epoch} for a sampler of {len(x)} batches. Leave "
                "steps_per_epoch out."
            )
        if arguments.get("shuffle"):
            raise ValueError(
                f"With {name}, the batches of one draw must reach the step "
                "in their order, one update's after another; shuffled, an "
                "update would mix parts of several draws, in which an "
                "example could count twice. Received: shuffle=True. Leave "
                "shuffle out (the draws are random already)."
            )
    passes = None
    if _fit_data.is_arrays(x):
        examples = _fit_data.array_examples(
            x, arguments.get("validation_split")
        )
        passes = _fit_data.array_batches(examples, arguments.get("batch_size"))[
            1
        ]
    elif sampling == "shuffle":
        passes = _fit_data.batches_per_epoch(x)
        if passes is None:
            raise ValueError(
                f"With {name}, every update's window must lie in one pass "
                "over the shuffled data, and custom_fit cannot tell how many "
                "batches a pass of this data holds. Received: "
                f"{type(x).__name__} data, stated as shuffled batches. Train "
                "on data with a length (arrays, a PyDataset, a DataLoader), "
                "or without accumulation."
            )
    for what, count in (
        ("batches in a pass over the data", passes),
        ("steps_per_epoch", per_epoch),
    ):
        if count is not None and count % accumulation:
            raise ValueError(
                f"With {name}, every update's window must lie in one pass "
                "over the shuffled data: a window that runs on into the next "
                "pass (or epoch) can hold an example twice, and the "
                "accountant counts one. Received: "
                f"{count} {what}, which {accumulation} does not divide. "
                "Pick a batch_size (or steps_per_epoch) that makes it a "
                f"multiple of {accumulation}."
            )


class ResumedRun(keras.callbacks.Callback):
    """Keys a run with given seeds by where it starts.

    Runs after the user's callbacks, once `BackupAndRestore` has restored
    the model. A generator from a given `noise_seed` that has drawn nothing
    in this process, and a sampler with a given seed that has trained no
    epoch, take streams keyed with the model's update count and a digest
    of its weights (`accounting.stream_key`): reproducible from the same
    start, and none of an earlier run's draws when the run continues one
    (a loaded model, weights loaded into a new one). Secret seeds need
    nothing: a new model or sampler draws a new one.
    """

    def __init__(self, model: Any, sampler: Any) -> None:
        super().__init__()
        self._private = model
        self._sampler = sampler
        # The optimizer's updates when training begins (restored ones
        # included), for `fit`'s count of updates against private steps.
        self.updates_at_start: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        model = self._private
        self.updates_at_start = int(
            ops.convert_to_numpy(model.optimizer.iterations)
        )
        record = _record.of(model)
        noise = model.noise_seed is not None and not record.noise_drawn
        sampler = self._sampler
        given = getattr(sampler, "seed_given", False)
        # Keras ends an epoch before the first one: no epoch trained.
        fresh = given and sampler.epoch <= 1
        if not (noise or fresh):
            return
        updates = self.updates_at_start
        start = _weights_digest(model)
        if noise:
            seeds = model._noise_seeds.state
            key = accounting.stream_key(model.noise_seed, updates, start)
            seeds.assign(ops.cast([key, 0], seeds.dtype))
            record.noise_drawn = True
        if fresh:
            sampler.continue_after(accounting.stream_key(0, updates, start) + 1)


def _weights_digest(model: Any) -> bytes:
    """A digest of process 0's weights (their values, in order).

    Every process keys its streams with process 0's digest: PyTorch
    processes may begin `fit` with weights of their own, which the first
    step replaces with process 0's.
    """
    digest = hashlib.blake2b(digest_size=16)
    for value in backend.current().local_values(model.weights):
        digest.update(
            np.ascontiguousarray(ops.convert_to_numpy(value)).tobytes()
        )
    rows = backend.current().gather_from_processes(list(digest.digest()))
    return bytes(int(byte) for byte in rows[0])


def refuse_what_the_private_gradient_leaves_out(model: Any) -> None:
    """Raises for a loss the private gradient would leave out.

    Each example's gradient is that of its compiled loss and
    `model.losses`: `RegularizationMixin`'s penalties, its
    `regularization_losses` hook and an overridden `compute_loss` would
    change the logged loss and not the update, without a word. SAM's
    second gradient is no clipped per-example gradient.
    """
    set_penalties = [
        f"{name}={getattr(model, name)!r}"
        for name in ("l1", "l2", "input_gradient_penalty")
        if getattr(model, name, None) is not None
    ]
    if set_penalties:
        raise ValueError(
            "DifferentialPrivacyMixin clips each example's gradient of "
            "the compiled loss and `model.losses`; RegularizationMixin's "
            "penalties would be left out of the private gradient (the "
            "update would be the same without them). Received: "
            f"{', '.join(set_penalties)}. For weight decay use the "
            "optimizer's (keras.optimizers.AdamW, or weight_decay=...); "
            "for a weight penalty a layer's kernel_regularizer (in "
            "model.losses, clipped with each example's gradient)."
        )
    for hook in ("train_step", "compute_gradients", "finalize_gradients"):
        owner = next((k for k in type(model).__mro__ if hook in vars(k)), None)
        if owner is not None and not _library_class(owner):
            raise ValueError(
                "DifferentialPrivacyMixin's step clips each example's "
                "gradient and adds the noise; a step of your own could "
                "update the weights without either, and the accountant "
                "would still count the run as private. Received: a "
                f"model class that overrides `{hook}` "
                f"({owner.__name__}). Change the update after the noise "
                "instead (override `transform_gradients`, which sees "
                "the private gradient), or train without the mixin."
            )
    for hook in ("compute_loss", "regularization_losses"):
        owner = next((k for k in type(model).__mro__ if hook in vars(k)), None)
        if owner is not None and not _library_class(owner):
            raise ValueError(
                "DifferentialPrivacyMixin clips each example's gradient "
                "of the compiled loss and `model.losses`, computed per "
                f"example; the {hook} of {owner.__name__} would be left "
                "out of the private gradient (the update would be the "
                "same without it). Received: a model class that "
                f"overrides `{hook}`. Compile the loss instead "
                "(model.compile(loss=...), one value per example), or "
                "add a term with a layer's add_loss or a "
                "kernel_regularizer."
            )
    if "sam_rho" in _options.declared_options(type(model)):
        raise ValueError(
            "DifferentialPrivacyMixin does not combine with "
            "SharpnessAwareMixin: SAM's update is the gradient at "
            "perturbed weights, which would be neither clipped per "
            "example nor noised as DP-SGD's. Received: a model class "
            f"with both ({type(model).__name__}). Leave one of them out."
        )
    seeds = _options.declared_states(type(model)).get("_noise_seeds")
    if not (
        isinstance(seeds, _options.Seeds)
        and seeds.secret
        and seeds.seed_option == "noise_seed"
        and not seeds.requires
    ):
        raise ValueError(
            "DifferentialPrivacyMixin draws its noise from a secret "
            "generator, seeded only by `noise_seed` when one is given; "
            "another would let whoever knows its seed subtract the noise. "
            f"Received: a model class ({type(model).__name__}) that "
            f"declares `_noise_seeds` as {seeds!r}. Leave `_noise_seeds` "
            "to DifferentialPrivacyMixin."
        )


def check_examples_apart(model: Any, arguments: dict[str, Any]) -> None:
    """Tries the model on fit's first batch, once: see `_independence`.

    A model whose training-mode state follows the data is refused;
    one that mixes a batch's examples leaves ghost clipping (refused
    with `clipping_method="ghost"`). Data that gives no batch before
    training (a generator) leaves ghost clipping too, unchecked.

    Raises:
        ValueError: Naming the variables, or why ghost clipping cannot
            be taken.
    """
    record = _record.of(model)
    if record.probed:
        return
    batch = _independence.first_batch(arguments)
    found = (
        _independence.Probe(checked=False)
        if batch is None
        else _independence.probe(model, batch)
    )
    found = _strictest_over_processes(found)
    if found.leaks:
        raise ValueError(
            "DifferentialPrivacyMixin: a training step of this model "
            "writes state computed from the data, which the noise does "
            "not cover (changing one example changed it), and which "
            "every later step and the saved model carry. Received: the "
            f"non-trainable variables {found.leaks}. Use a layer that "
            "keeps no batch statistics (keras.layers.GroupNormalization "
            "or LayerNormalization instead of BatchNormalization), or "
            "freeze the layer (layer.trainable = False keeps its "
            "statistics)."
        )
    reason = found.mixing
    if not found.checked:
        reason = (
            "custom_fit could not check that the model keeps a batch's "
            "examples apart: "
            + (
                "the data gives no batch before training (a generator)"
                if batch is None
                else "the first batch holds fewer than two different examples"
            )
        )
    if reason and model.clipping_method == "ghost":
        raise ValueError(
            "`clipping_method='ghost'` needs each example's loss to "
            f"depend on that example alone, and {reason}. Received: "
            "clipping_method='ghost'. Use clipping_method='auto' (which "
            "then computes each example's gradient on its own) or "
            "'vectorized'"
            + (
                ", or data custom_fit can read before "
                "training (arrays, a PyDataset, a tf.data.Dataset)."
                if not found.checked
                else "."
            )
        )
    if reason and not record.ghost_blocker:
        record.ghost_blocker = reason
    record.probed = True


def close_open_windows(model: Any) -> None:
    """Drops the sums of an update's window an earlier fit left open.

    A fit stopped within a window (a budget, an interrupt,
    `steps_per_epoch`) leaves its batches' clipped sums pending; the
    next fit's batches would join them in one update, in which an
    example of both could count twice. They were never released (no
    noise was added, no update made), so they are dropped.
    """
    for accumulator in _model_state.state_of(model).accumulators.values():
        pending = accumulator.pending(model)
        if pending:
            accumulator.restart()
            warnings.warn(
                f"An earlier fit stopped within an update of "
                f"gradient_accumulation_steps={accumulator.steps}: the "
                f"clipped sums of its last {pending} batches are dropped "
                "(they were never released), so that no update mixes the "
                "batches of two fits, in which an example could count "
                "twice. Fit whole updates (steps_per_epoch and epochs "
                "that are multiples of gradient_accumulation_steps) to "
                "lose none.",
                UserWarning,
                stacklevel=4,
            )


def check_microbatches_divide(model: Any, arguments: dict[str, Any]) -> None:
    """Refuses arrays whose batches `num_microbatches` does not divide.

    Before the first step: the step checks each batch as it arrives,
    which on TensorFlow (a batch of unknown size in the traced step)
    is a graph assertion after a whole epoch. The global batch is
    checked; a replica's share divides only if it does.
    """
    count = model.num_microbatches
    x = arguments.get("x")
    if count is None or not _fit_data.is_arrays(x):
        return
    examples = _fit_data.array_examples(x, arguments.get("validation_split"))
    size, _ = _fit_data.array_batches(examples, arguments.get("batch_size"))
    sizes = [size] + ([examples % size] if examples % size else [])
    for batch in sizes:
        if batch % count:
            raise ValueError(
                "`num_microbatches` must divide every batch size. "
                f"Received: num_microbatches={count} for a batch of "
                f"{batch} ({examples} training examples in batches of "
                f"{size}). Pick a divisor of every batch size, or a "
                "number of examples divisible by the batch size."
            )


def refuse_dynamic_loss_scale(optimizer: Optimizer) -> None:
    """Raises for a `LossScaleOptimizer`: its scale follows the data."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "DifferentialPrivacyMixin does not combine with dynamic loss "
            "scaling: a LossScaleOptimizer lowers its scale when a "
            "gradient overflows, a decision taken on the data that the "
            "accountant does not count, and DP-SGD gives a microbatch "
            "whose gradient is not finite a zero gradient instead, so the "
            "scale would never come down. Received: optimizer="
            f"{type(optimizer).__name__} (the 'mixed_float16' policy "
            "wraps the optimizer in one). Use the 'mixed_bfloat16' "
            "policy, or float32, or a fixed loss_scale_factor on the "
            "optimizer."
        )


def refuse_batch_mixing(model: Any) -> None:
    """Raises if a layer mixes the examples of a batch in training."""
    for layer in _keras_compat.all_layers(model):
        # A frozen one runs in inference mode: its statistics are fixed.
        if layer.trainable and isinstance(
            layer, keras.layers.BatchNormalization
        ):
            raise ValueError(
                "DifferentialPrivacyMixin trains one example at a time, "
                "and BatchNormalization in training mode mixes the "
                "examples of a batch: each example's gradient depends "
                "on the others, so clipping it bounds nothing. "
                f"Received: the layer {layer.name!r}. Use "
                "keras.layers.GroupNormalization or "
                "LayerNormalization instead."
            )


def checked_fit(
    model: Any,
    fit: Callable[..., Any],
    arguments: dict[str, Any],
    run: accounting.TrainingRun,
    budgets: list[Any],
    slot: Any,
) -> Any:
    """Runs `fit` (Keras') on `arguments`, once `run` is checked.

    Orders the callbacks (the budgets first, the resumed run's keys last),
    hands the step an audit's `slot` (or `None`), counts the passes begun,
    and refuses a fit in which the optimizer made more updates than the
    private mechanism ran.

    Args:
        model: The `DifferentialPrivacyMixin` model.
        fit: `keras.Model.fit`, bound to `model`.
        arguments: `fit`'s arguments, by name.
        run: The accounted run (`accounted_run`).
        budgets: The `PrivacyBudget` callbacks among them.
        slot: An audit's slot, or `None`.

    Returns:
        The `History`.

    Raises:
        RuntimeError: If some updates did not go through the private step.
    """
    check_microbatches_divide(model, arguments)
    check_examples_apart(model, arguments)
    close_open_windows(model)
    record = _record.of(model)
    x = arguments.get("x")
    resumed = ResumedRun(model, x if _fit_data.is_sampler(x) else None)
    # The budgets first, so that every other callback's logs hold the
    # epoch's epsilon (they read the steps run when the first epoch
    # begins, after any restore); the resumed run's keys last, after
    # the user's (`BackupAndRestore` restores first). A `CallbackList`
    # is reordered in place (its model is set already).
    callbacks = arguments.get("callbacks")
    listed = getattr(callbacks, "callbacks", callbacks) or []
    ordered = [
        *budgets,
        *[c for c in listed if c not in budgets],
        resumed,
    ]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks = ordered
    else:
        arguments["callbacks"] = ordered
    record.run = run
    started = model.private_steps
    if slot is not None:
        # A step records an audit's canaries if traced with it (and
        # only then: the train function is made again after the fit).
        model.train_function = None
    record.audit = slot
    try:
        history = fit(**arguments)
    finally:
        if slot is not None:
            record.audit = None
            model.train_function = None
        record.noise_drawn = True
        ran = model.private_steps - started
        record.passes += accounting.passes_begun(run, ran)
    if resumed.updates_at_start is not None:
        # From the updates when training began (restored ones counted).
        made = int(ops.convert_to_numpy(model.optimizer.iterations))
        made -= resumed.updates_at_start
        if made > ran:
            raise RuntimeError(
                f"The optimizer made {made} updates in this "
                f"fit, and the private mechanism ran {ran} times: some "
                "updates did not go through DifferentialPrivacyMixin's "
                "step (a step, callback or optimizer of your own "
                "applied gradients), and the weights are not private. "
                "Received: those extra updates. Update the weights only "
                "through the model's step."
            )
    return history
