"""`DifferentialPrivacyMixin`: DP-SGD inside `fit`."""

import hashlib
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _canaries
from custom_fit import _fit_data
from custom_fit import _ghost_layers
from custom_fit import _independence
from custom_fit import _keras_compat
from custom_fit import _keras_model
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _validation
from custom_fit import auditing
from custom_fit import backend
from custom_fit import callbacks as callbacks_module
from custom_fit import per_example
from custom_fit import pipeline
from custom_fit import privacy
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.train_step_mixin import BatchLoss
from custom_fit.train_step_mixin import TrainStepMixin

# The ways to clip each example's gradient (`clipping_method`).
CLIPPING_METHODS = ("auto", "ghost", "vectorized")


def _number(name: str, value: Any, zero_allowed: bool) -> float | None:
    """Validates a required float option (`None`: not given)."""
    if value is None:
        return None
    if zero_allowed and value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return _validation.positive_float_or_none(name, value)
    except ValueError:
        bound = (
            ">= 0 (0 adds no noise, and so gives no privacy)"
            if zero_allowed
            else "greater than 0"
        )
        raise ValueError(
            f"`{name}` must be a finite float {bound}. Received: "
            f"{name}={_validation.shown(value)}. Pass for example "
            f"{name}={1.1 if zero_allowed else 1.0}."
        ) from None


def _clip(name: str, value: Any) -> float | None:
    """Validates `l2_norm_clip`: a finite float > 0."""
    return _number(name, value, zero_allowed=False)


def _noise(name: str, value: Any) -> float | None:
    """Validates `noise_multiplier`: a finite float >= 0 (0: no noise).

    A `privacy.CalibratedNoise` is kept as it is: `fit` checks its run.
    """
    number = _number(name, value, zero_allowed=True)
    return value if isinstance(value, privacy.CalibratedNoise) else number


def _training_run(
    arguments: dict[str, Any], accumulation: int
) -> privacy.TrainingRun:
    """Returns how `fit`, called with `arguments`, draws its batches.

    With `accumulation` batches per update, the mechanism runs once per
    logical batch of `accumulation` batches.
    """
    x = arguments.get("x")
    epochs = arguments.get("epochs", 1) - arguments.get("initial_epoch", 0)
    per_epoch = arguments.get("steps_per_epoch")
    sampling = getattr(x, "sampling", None)
    if sampling in privacy.SAMPLINGS:
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
    return privacy.TrainingRun(
        sampling, batch_size, num_examples, steps, described
    )


def _across_processes(run: privacy.TrainingRun) -> privacy.TrainingRun:
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
    return privacy.TrainingRun(
        run.sampling,
        None if run.batch_size is None else run.batch_size * processes,
        sum(examples.values()),
        run.steps,
        f"{run.described} in each of {processes} processes",
    )


def _check_run_seen_over_processes(
    x: Any, run: privacy.TrainingRun, accounted: bool
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


def _check_padded_shares(x: Any) -> None:
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


def _check_windows(
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


class _ResumedRun(keras.callbacks.Callback):
    """Keys a run with given seeds by where it starts.

    Runs after the user's callbacks, once `BackupAndRestore` has restored
    the model. A generator from a given `noise_seed` that has drawn nothing
    in this process, and a sampler with a given seed that has trained no
    epoch, take streams keyed with the model's update count and a digest
    of its weights (`privacy.stream_key`): reproducible from the same
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
        state = _model_state.state_of(model)
        noise = model.noise_seed is not None and not state.dp_noise_drawn
        sampler = self._sampler
        given = getattr(sampler, "seed_given", False)
        # Keras ends an epoch before the first one: no epoch trained.
        fresh = given and sampler.epoch <= 1
        if not (noise or fresh):
            return
        updates = self.updates_at_start
        start = _weights_digest(model)
        if noise:
            seeds = state.dp_seeds.state
            key = privacy.stream_key(model.noise_seed, updates, start)
            seeds.assign(ops.cast([key, 0], seeds.dtype))
            state.dp_noise_drawn = True
        if fresh:
            sampler.continue_after(privacy.stream_key(0, updates, start) + 1)


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


class DifferentialPrivacyMixin(TrainStepMixin):
    """Differentially private training (DP-SGD) with `fit`.

    Each training step computes the true gradient of every microbatch (one
    example by default, or `num_microbatches` groups of consecutive
    examples, each microbatch's loss the mean of its examples' losses),
    clips each to `l2_norm_clip` in global norm over all trainable
    variables, sums them, adds Gaussian noise of standard deviation
    `noise_multiplier * l2_norm_clip` once per coordinate, and divides by
    the number of microbatches, as TensorFlow Privacy's Keras optimizers do
    (Abadi et al. 2016). That gradient then goes through the rest of the
    pipeline (`transform_gradients`, inspection, the optimizer).

    With one example per microbatch and every trained variable in a
    Dense, EinsumDense, Embedding, Conv1D, Conv2D or Conv3D layer (LoRA
    weights of `enable_lora` included), no per-example gradient is formed
    ("ghost clipping", `custom_fit.ghost`): one forward pass records each
    such layer's inputs and the gradients of the examples' summed loss
    with respect to its outputs, from which each example's gradient norm
    follows, and the clipped sum is the same tensors contracted with the
    clip factors. It gives the same result as per-example gradients at
    about the cost of one ordinary step. Otherwise (another layer with
    weights, microbatches of several examples, a loss added in a layer's
    call, a custom loss function, a supported layer called from code Keras
    did not write) per-microbatch gradients are vectorized
    (`tf.vectorized_map` on TensorFlow, `jax.vmap` on JAX, `torch.vmap`);
    on TensorFlow, a model with an op that cannot be vectorized (dropout's
    random seed, say), and on PyTorch (Keras' channels-last Conv2D, say),
    is differentiated one microbatch after another instead, with a
    one-time warning. `clipping_method` chooses; the
    model's `per_example_clipping` says which path a step takes, and
    `per_example_clipping_reason` why. On the ghost path each example gets
    its own dropout draw (the batch's forward pass). The noise
    comes from a generator in the model's state seeded from the operating
    system's entropy (62 bits or more; never saved, not copied by
    `clone_model`), so that nobody can predict it: whoever could would
    subtract it from the released weights. `noise_seed` makes a run
    reproducible, for tests, and warns: the seed is then as secret as the
    data. Over several processes the seed is process 0's; under
    `tf.distribute` each replica clips its own examples, the clipped sums
    are summed across replicas, and the same noise is added once for the
    global batch (the replicas draw it from the same state); on JAX the
    step sees the global batch.

    A microbatch whose gradient is not finite (a NaN in an example, say)
    contributes zero to the sum and still counts among the microbatches,
    so the noisy gradient stays finite: no decision about the step
    (`skip_nonfinite`'s skip included) depends on one example's data,
    only on the noisy result. Every step runs the mechanism and is
    counted in `private_steps`, skipped updates included.

    Batches drawn by `custom_fit.sampling.PoissonSampler` (what the
    accountant assumes) have random sizes: pass the sampler's `batch_size`
    as `expected_batch_size`, and the noisy sum is divided by that fixed
    number instead of the batch's size (which would tell whether an
    example is in it). A microbatch whose sample weights are all 0 (such
    a batch's padding rows) contributes nothing, not even the gradient of
    `model.losses` that its loss includes.

    With `gradient_accumulation_steps=k`, each batch's microbatches are
    clipped as above and their clipped sums accumulated; the noise is added
    once per update, to the sum over its `k` batches (a logical batch of
    `k` times the batch size), which is then divided by the logical
    batch's microbatch count (or `expected_batch_size`, the logical batch's
    expected size). An example must be in an update at most once: Poisson
    batches come from a `PoissonSampler(..., gradient_accumulation_steps=
    k)`, which deals one draw into the update's `k` batches; shuffled
    batches need passes (and `steps_per_epoch`) of a whole number of
    updates; anything else is refused before the first step, and a
    window an earlier fit left open is dropped. `private_steps` counts
    updates: the mechanism runs once per logical batch, which is what the
    accountant must be told
    (`PrivacyBudget` multiplies its `batch_size` by `k`).

    The logged loss and metrics are those of a forward pass over the whole
    batch. `logs["dp_clipped_fraction"]` is the share of microbatches whose
    gradient was clipped (or zeroed, when not finite). How much privacy a
    run spends is the accountant's business: `custom_fit.privacy.epsilon`
    and `custom_fit.callbacks.PrivacyBudget`; to ask for a target epsilon,
    calibrate the noise with `custom_fit.privacy.calibrate_noise`.

    Before its first step `fit` tries the model on the first batch of its
    data (`stateless_call`s in training mode, the model left as it was):
    where changing one example moves another's output or loss (batch
    statistics, a normalization or a loss over the batch axis), ghost
    clipping is not taken; where the state a training step writes follows
    the data (a BatchNormalization's moving statistics, at any depth) the
    model is refused: use `keras.layers.GroupNormalization` or
    `LayerNormalization`, or freeze the layer. Data that can be read only
    once (a generator) is not tried, and ghost clipping is not taken.
    What the private gradient would leave out is refused when the model is
    built: `RegularizationMixin`'s penalties, an overridden `compute_loss`
    or `regularization_losses`, and `SharpnessAwareMixin`.
    Dynamic loss scaling (`LossScaleOptimizer`, the `mixed_float16`
    policy) is refused too: it lowers its scale when a gradient overflows,
    a decision taken on the data; use `mixed_bfloat16`.

    Args:
        l2_norm_clip: Float > 0. The bound of each microbatch's gradient
            norm. Required.
        noise_multiplier: Float >= 0. The noise's standard deviation as a
            multiple of `l2_norm_clip` (0 adds none: no privacy, for tests).
            Required.
        num_microbatches: Integer or `None`. The number of microbatches per
            batch, which must divide the batch size; `None` (the default)
            makes every example a microbatch.
        noise_seed: Integer >= 0 or `None`. Seed of the noise, for a
            reproducible run (warns: whoever knows it can remove the
            noise). `None` (the default): a secret seed from the operating
            system. Never saved; a run that continues after a given seed's
            updates (a loaded model, `BackupAndRestore`) draws a stream of
            its own, none of the earlier noise.
        expected_batch_size: Float > 0 or `None`. With Poisson-sampled
            batches, their expected size (`PoissonSampler.batch_size`; with
            accumulation, the logical batch's): the noisy sum is divided by
            it. `None` (the default) divides by the
            number of microbatches of each batch. Needs one example per
            microbatch (`num_microbatches=None`).
        clipping_method: String. How each example's gradient is clipped:
            `"auto"` (the default) takes ghost clipping where it applies
            (a layer of another kind whose weights are all its own, such
            as a LayerNormalization, gets per-example gradients of its
            weights alone) and per-example gradients of the whole model
            elsewhere; `"ghost"` asks for ghost
            clipping and refuses a model it cannot handle, naming the
            layer (it also accepts supported layers called from a custom
            layer or model, trusting that code to read their weights only
            through their own calls, on whole batches); `"vectorized"`
            always computes per-example gradients. The result is the same.

    Attributes:
        private_steps: Integer. The private steps run so far (the
            mechanism's invocations: one per update, skipped updates
            included), over every
            `fit` of this model; custom_fit state, not saved with the
            model.
        per_example_clipping: String, `"ghost"` or `"vectorized"`: how the
            next step clips. Decided from the model's layers; the first
            step may revise `"ghost"` to `"vectorized"` when it finds a
            loss added in a layer's call or a custom loss function.
        per_example_clipping_reason: String. Why, naming the layer (or
            the loss) in the way of ghost clipping.

    Example:

    ```python
    class Net(custom_fit.DifferentialPrivacyMixin, keras.Model):
        pass

    inputs = keras.Input((8,))
    model = Net(inputs, keras.layers.Dense(3)(inputs), l2_norm_clip=1.0,
                noise_multiplier=1.1, noise_seed=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.per_example_clipping  # "ghost": Dense layers only
    ```

    References:
        - [Abadi et al., 2016](https://arxiv.org/abs/1607.00133), "Deep
          Learning with Differential Privacy".
        - [Li et al., 2022](https://arxiv.org/abs/2110.05679), "Large
          Language Models Can Be Strong Differentially Private Learners"
          (ghost clipping).
    """

    reports = ("dp_clipped_fraction",)

    l2_norm_clip = _options.Option(None, _clip, bound=True, required=True)
    noise_multiplier = _options.Option(None, _noise, required=True)
    num_microbatches = _options.Option(None, _validation.positive_int_or_none)
    noise_seed = _options.Option(None, _validation.seed_or_none, saved=False)
    expected_batch_size = _options.Option(
        None, _validation.positive_float_or_none
    )
    clipping_method = _options.Option(
        "auto", _validation.one_of(CLIPPING_METHODS)
    )
    # Every step the mechanism ran (`private_steps`), skipped ones included.
    _private_step_count = _options.State((), "int32")

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Checks the options; makes the noise's generator and the count."""
        super()._configure_options(options)
        if self.per_loss_gradients:
            raise ValueError(
                "DifferentialPrivacyMixin does not combine with "
                "`per_loss_gradients`: each microbatch's gradient is clipped "
                "as one. Received: per_loss_gradients="
                f"{self.per_loss_gradients!r}. Leave `per_loss_gradients` "
                "out."
            )
        if self.expected_batch_size is not None and (
            self.num_microbatches is not None
        ):
            raise ValueError(
                "`expected_batch_size` (Poisson-sampled batches) needs one "
                "example per microbatch: a batch of random size split into "
                "a fixed number of microbatches moves every example when "
                "one is added, so no microbatch's clip bounds one example's "
                "influence. Received: expected_batch_size="
                f"{self.expected_batch_size}, num_microbatches="
                f"{self.num_microbatches}. Leave num_microbatches out."
            )
        if self.clipping_method == "ghost" and (
            self.num_microbatches is not None
        ):
            raise ValueError(
                "`clipping_method='ghost'` clips each example's gradient from "
                "its layers' inputs and output gradients, so it needs one "
                "example per microbatch. Received: clipping_method='ghost', "
                f"num_microbatches={self.num_microbatches}. Leave "
                "num_microbatches out, or use clipping_method='auto'."
            )
        self._refuse_what_the_private_gradient_leaves_out()
        state = _model_state.state_of(self)
        state.dp_seeds = backend.current().secret_seeds(self.noise_seed)
        state.holder.track(state.dp_seeds.state)
        if self.noise_seed is not None:
            warnings.warn(
                f"noise_seed={self.noise_seed} makes the noise of every "
                "update reproducible: whoever knows the seed can subtract the "
                "noise from the released weights, and the privacy is gone. "
                "Keep the seed as secret as the data, for tests and "
                "reproducible runs only; leave it out for a secret seed drawn "
                "from the operating system (it is never saved with the "
                "model).",
                UserWarning,
                stacklevel=4,
            )

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Trains the model: `keras.Model.fit`, with the same arguments.

        Before the first step it checks that the batches are drawn as the
        model divides and accounts them: a `PoissonSampler` needs
        `expected_batch_size` equal to its batch size (with
        `gradient_accumulation_steps=k`, its logical batch, and a sampler
        that serves each draw as `k` batches), shuffled batches (arrays)
        need it left out (and, with accumulation, passes of a whole number
        of updates), and a noise from `custom_fit.privacy.calibrate_noise`
        must see the sampling, batch size and data set size it was
        calibrated for, and a `custom_fit.callbacks.PrivacyBudget` among the
        callbacks must be told the data set size and batch size `fit`
        trains with. A fit that runs past the calibrated steps warns. Over
        several processes the noise's secret seed is process 0's. An
        update's window that an earlier `fit` left open is dropped (with a
        warning): its batches were never released. A run that continues
        an earlier one (a loaded model, `BackupAndRestore`) with a given
        `noise_seed` or sampler seed draws no noise or batch of that run
        again (see `noise_seed`).

        Returns:
            A `History` object, as `keras.Model.fit` returns.

        Raises:
            ValueError: When the run would not be the one accounted.
        """
        arguments = _keras_model.fit_arguments(self, args, kwargs)
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
        accumulation = self.gradient_accumulation_steps or 1
        run = _training_run(arguments, accumulation)
        _check_run_seen_over_processes(
            arguments.get("x"),
            run,
            bool(budgets)
            or isinstance(self.noise_multiplier, privacy.CalibratedNoise),
        )
        run = _across_processes(run)
        run = privacy.stated_run(run, budgets, accumulation)
        _check_windows(arguments, accumulation, run.sampling)
        _check_padded_shares(arguments.get("x"))
        updates = int(ops.convert_to_numpy(self.optimizer.iterations))
        warning = privacy.check_run(
            self.noise_multiplier,
            self.expected_batch_size,
            run,
            max(self.private_steps, updates),
            self.num_microbatches,
            accumulation,
        )
        for callback in budgets:
            privacy.check_accounted_run(
                callback.num_examples, callback.batch_size * accumulation, run
            )
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        audit = auditing.audit_of_fit(self, arguments)
        with auditing.feeding(audit, self) as slot:
            return self._checked_fit(arguments, run, budgets, slot)

    def _checked_fit(
        self,
        arguments: dict[str, Any],
        run: privacy.TrainingRun,
        budgets: list[Any],
        slot: Any,
    ) -> Any:
        """`fit`, once `run` is checked; `slot`: an audit's, or `None`."""
        self._check_microbatches_divide(arguments)
        self._check_examples_apart(arguments)
        self._close_open_windows()
        state = _model_state.state_of(self)
        backend.current().agree_on_seeds(
            state.dp_seeds, given=self.noise_seed is not None
        )
        x = arguments.get("x")
        resumed = _ResumedRun(self, x if _fit_data.is_sampler(x) else None)
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
        state.dp_run = run
        started = self.private_steps
        if slot is not None:
            # A step records an audit's canaries if traced with it (and
            # only then: the train function is made again after the fit).
            self.train_function = None
        state.dp_audit = slot
        try:
            history = super().fit(**arguments)
        finally:
            if slot is not None:
                state.dp_audit = None
                self.train_function = None
            state.dp_noise_drawn = True
            ran = self.private_steps - started
            state.dp_passes += privacy.passes_begun(run, ran)
        if resumed.updates_at_start is not None:
            # From the updates when training began (restored ones counted).
            made = int(ops.convert_to_numpy(self.optimizer.iterations))
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

    def _refuse_what_the_private_gradient_leaves_out(self) -> None:
        """Raises for a loss the private gradient would leave out.

        Each example's gradient is that of its compiled loss and
        `model.losses`: `RegularizationMixin`'s penalties, its
        `regularization_losses` hook and an overridden `compute_loss` would
        change the logged loss and not the update, without a word. SAM's
        second gradient is no clipped per-example gradient.
        """
        set_penalties = [
            f"{name}={getattr(self, name)!r}"
            for name in ("l1", "l2", "input_gradient_penalty")
            if getattr(self, name, None) is not None
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
            owner = next(
                (k for k in type(self).__mro__ if hook in vars(k)), None
            )
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
            owner = next(
                (k for k in type(self).__mro__ if hook in vars(k)), None
            )
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
        if "sam_rho" in _options.declared_options(type(self)):
            raise ValueError(
                "DifferentialPrivacyMixin does not combine with "
                "SharpnessAwareMixin: SAM's update is the gradient at "
                "perturbed weights, which would be neither clipped per "
                "example nor noised as DP-SGD's. Received: a model class "
                f"with both ({type(self).__name__}). Leave one of them out."
            )

    def _check_examples_apart(self, arguments: dict[str, Any]) -> None:
        """Tries the model on fit's first batch, once: see `_independence`.

        A model whose training-mode state follows the data is refused;
        one that mixes a batch's examples leaves ghost clipping (refused
        with `clipping_method="ghost"`). Data that gives no batch before
        training (a generator) leaves ghost clipping too, unchecked.

        Raises:
            ValueError: Naming the variables, or why ghost clipping cannot
                be taken.
        """
        state = _model_state.state_of(self)
        if state.dp_probed:
            return
        batch = _independence.first_batch(arguments)
        found = (
            _independence.Probe(checked=False)
            if batch is None
            else _independence.probe(self, batch)
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
                    else "the first batch holds fewer than two different "
                    "examples"
                )
            )
        if reason and self.clipping_method == "ghost":
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
        if reason and not state.dp_ghost_blocker:
            state.dp_ghost_blocker = reason
        state.dp_probed = True

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a private model trains with `fit`.

        `fit` checks the run against the accountant before its first step
        (the sampling, the accumulation windows, the model on its first
        batch, the noise's secret seed over processes); a batch given by
        hand passes none of those checks, and no accountant sees it.

        Raises:
            ValueError: Always.
        """
        raise ValueError(
            "DifferentialPrivacyMixin trains with `fit`, which checks the "
            "run against the accountant before its first step (how the "
            "batches are drawn, the model's examples kept apart, the "
            "noise's seed) and counts every private step; a batch given by "
            "hand passes none of those checks. Received: a call of "
            "train_on_batch. Call fit(x, y, batch_size=..., epochs=1) (or "
            "fit on a PoissonSampler)."
        )

    def _close_open_windows(self) -> None:
        """Drops the sums of an update's window an earlier fit left open.

        A fit stopped within a window (a budget, an interrupt,
        `steps_per_epoch`) leaves its batches' clipped sums pending; the
        next fit's batches would join them in one update, in which an
        example of both could count twice. They were never released (no
        noise was added, no update made), so they are dropped.
        """
        for accumulator in _model_state.state_of(self).accumulators.values():
            pending = accumulator.pending(self)
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
                    stacklevel=3,
                )

    @property
    def private_steps(self) -> int:
        """The private steps run so far, skipped updates included."""
        return int(backend.current().host_value(self, self._private_step_count))

    @property
    def per_example_clipping(self) -> str:
        """How the next step clips: `"ghost"` or `"vectorized"`."""
        return self._clipping_choice(self._clipped_variables())[0]

    @property
    def per_example_clipping_reason(self) -> str:
        """Why `per_example_clipping` is what it is, naming the layer."""
        return self._clipping_choice(self._clipped_variables())[1]

    def compute_gradients(
        self,
        loss_function: Callable[[], tuple[Tensor, Any]],
        variables: Sequence[Variable] | None,
        optimizer: Optimizer | None = None,
    ) -> tuple[Tensor, Any, Gradients]:
        """Returns the batch's loss and output, and its clipped sum.

        The loss and `y_pred` of a forward pass over the whole batch are
        what the step logs; the gradient is the sum over the batch's
        microbatches of each one's true gradient clipped to
        `l2_norm_clip` (summed across replicas), which
        `finalize_gradients` noises and divides once per update. The rest
        of the step (accumulation, the guard, the update) is
        `TrainStepMixin`'s.

        Args:
            loss_function: The step's `BatchLoss`: the examples come from
                it.
            variables: The variables to differentiate, or `None` for the
                model's trainable variables.
            optimizer: The optimizer of this update.

        Returns:
            A tuple `(loss, y_pred, sums)`; variables Keras overwrites with
            their gradient (float8 state) get `None`: no private value.

        Raises:
            ValueError: For a loss function without its batch (`minimize`
                with a plain function), a layer that mixes examples, or
                dynamic loss scaling.
        """
        if not isinstance(loss_function, BatchLoss):
            raise ValueError(
                "DifferentialPrivacyMixin clips the gradient of each example, "
                "so it needs the batch's examples, which `fit`'s training "
                "step gives it. Received: a loss function without its batch "
                "(`minimize` called with a function). Train the private "
                "model with `fit`, or pass a `custom_fit.BatchLoss`."
            )
        optimizer = optimizer or self.optimizer
        self._refuse_batch_mixing()
        self._refuse_dynamic_loss_scale(optimizer)
        if variables is None:
            variables = self.trainable_variables
        weighted = [v for v in variables if not pipeline.is_overwritten(v)]
        found = None
        if self._clipping_choice(weighted)[0] == "ghost":
            found = self._ghost_clipped_sums(loss_function, weighted, optimizer)
        if found is None:
            loss, y_pred = loss_function()
            clipped = self._clipped_sums(
                loss_function.x,
                loss_function.y,
                loss_function.sample_weight,
                weighted,
                optimizer,
            )
        else:
            loss, y_pred, clipped = found
        sums = iter(clipped)
        gradients: Gradients = [
            None if pipeline.is_overwritten(v) else next(sums)
            for v in variables
        ]
        return loss, y_pred, gradients

    def finalize_gradients(
        self,
        gradients: Gradients,
        variables: Sequence[Variable],
        is_update: Tensor | None = None,
    ) -> Gradients:
        """Returns the private gradient: the clipped sums, noised, divided.

        Gaussian noise of standard deviation `noise_multiplier *
        l2_norm_clip` is added once per update (with accumulation, to the
        sum over the update's micro-batches: once per logical batch), then
        the sum is divided by the number of microbatches of the update (or
        by `expected_batch_size`). The update is counted in
        `private_steps`.

        Args:
            gradients: The clipped sums (with accumulation, their mean over
                the micro-batches so far).
            variables: The variables.
            is_update: As in `TrainStepMixin.finalize_gradients`.

        Returns:
            The private gradients, aligned with `variables`.
        """
        state = _model_state.state_of(self)
        steps = self.gradient_accumulation_steps or 1
        sums = [None if g is None else g * steps for g in gradients]
        slot = self._audit_slot_sums(state, is_update)
        if self.noise_multiplier:
            seeds = state.dp_seeds
            before = backend.current().read(seeds.state)
            clip = ops.cast(self.l2_norm_clip, "float32")
            present = [g for g in sums if g is not None]
            if slot is not None:
                # An audit's slot is noised with the rest, in the same call.
                present.append(slot[0])
            noisy = iter(
                privacy.add_noise(
                    present,
                    ops.cast(self.noise_multiplier, "float32") * clip,
                    seeds,
                )
            )
            sums = [None if g is None else next(noisy) for g in sums]
            if slot is not None:
                self._record_audit(state, next(noisy), slot[1], is_update)
            if is_update is not None:
                # The generator moves on once per update, not per batch.
                backend.current().restore_if(
                    ops.logical_not(is_update), [seeds.state], [before]
                )
        if self.expected_batch_size is not None:
            count: Any = ops.cast(self.expected_batch_size, "float32")
        else:
            count = state.local.dp_microbatches * steps
        # The mechanism runs once per update, whatever becomes of it.
        counter = self._private_step_count
        current = backend.current().read(counter)
        counter.assign(
            current + 1
            if is_update is None
            else ops.where(is_update, current + 1, current)
        )
        return [
            None if g is None else ops.cast(g / count, v.dtype)
            for g, v in zip(sums, variables)
        ]

    def train_step(self, data: Any) -> Any:
        """Runs one training step (see `TrainStepMixin.train_step`).

        In a fit audited by `auditing.CanaryAudit`, the batch's canary
        rows are told apart by their sample weights first: they reach the
        model's loss with weight 0, and their gradients only the audit's
        slot (`custom_fit._canaries`).
        """
        state = _model_state.state_of(self)
        if state.dp_audit is not None:
            x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
            state.local.audit_rows, weights = _canaries.decode(weights)
            data = (x, y, weights)
        return super().train_step(data)

    def _audit_slot_sums(
        self, state: Any, is_update: Tensor | None
    ) -> Tensor | None:
        """The audit's clipped slot sums and canary rows of the update.

        With accumulation, those of the update's batches so far (kept in
        the audit's state until the update). `None` without an audit.
        """
        audit = state.dp_audit
        if audit is None:
            return None
        found = state.local.audit_sums
        if is_update is not None:
            found = found + backend.current().read(audit.pending)
            audit.pending.assign(
                ops.where(is_update, ops.zeros_like(found), found)
            )
        return found

    def _record_audit(
        self,
        state: Any,
        noisy: Tensor,
        rows: Tensor,
        is_update: Tensor | None,
    ) -> None:
        """Records the update's noisy slot sum in the audit's statistics."""
        statistics = state.dp_audit.statistics
        before = backend.current().read(statistics)
        after = _canaries.recorded(before, noisy, rows)
        if is_update is not None:
            after = ops.where(is_update, after, before)
        statistics.assign(after)

    def _clipped_sums(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        variables: list[Variable],
        optimizer: Optimizer,
    ) -> Gradients:
        """Returns the sums of the clipped microbatch gradients, vectorized.

        Summed across replicas (`per_example.vectorized_clipped_sums`); the
        number of microbatches of the global batch is kept for
        `finalize_gradients` (`local.dp_microbatches`).
        """
        microbatches = self._microbatch_count(x)
        clipped, vectorized = per_example.vectorized_clipped_sums(
            self,
            x,
            y,
            sample_weight,
            variables,
            optimizer,
            ops.cast(self.l2_norm_clip, "float32"),
            microbatches,
        )
        if not vectorized:
            self._warn_once(
                "dp_vectorization",
                "DifferentialPrivacyMixin: an op of the model cannot be "
                "vectorized over microbatches, so their gradients are "
                "computed one after another (slower, same result).",
            )
        self._note_clipping(x, clipped.norms, clipped.mask, microbatches)
        return clipped.sums

    def _note_clipping(
        self, x: Any, norms: Tensor, mask: Any, microbatches: int | None
    ) -> None:
        """Reports the clipped share; keeps the global microbatch count."""
        clip = ops.cast(self.l2_norm_clip, "float32")
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
        self.report_metric(
            "dp_clipped_fraction", clipped / ops.maximum(total, 1.0)
        )
        state = _model_state.state_of(self)
        if state.dp_audit is not None:
            # The canaries' rows, clipped as the examples' are: the global
            # batch's, summed over replicas as the clipped sums are.
            sums = _canaries.slot_sums(
                norms,
                mask,
                state.local.audit_rows,
                clip,
                state.dp_audit.num_canaries,
            )
            state.local.audit_sums = backend.current().all_reduce_sum([sums])[
                0
            ]
        # The global batch's count: this replica's, summed over replicas.
        summed_count = backend.current().summed_count
        if microbatches is None:
            count: Any = summed_count(_keras_compat.batch_size(x, "float32"))
        else:
            count = summed_count(float(microbatches))
        state.local.dp_microbatches = count

    def _clipped_variables(self) -> list[Variable]:
        """The variables a step clips: the trainable ones, not float8."""
        return [
            v
            for v in self.trainable_variables
            if not pipeline.is_overwritten(v)
        ]

    def _clipping_choice(
        self, variables: Sequence[Variable]
    ) -> tuple[str, str]:
        """Returns `(method, reason)`: how a step clips `variables`, and why.

        Raises:
            ValueError: For `clipping_method="ghost"` and a model it cannot
                handle, naming the layer.
        """
        if self.clipping_method == "vectorized":
            return "vectorized", "clipping_method='vectorized' was asked for"
        if self.num_microbatches is not None:
            return "vectorized", (
                "microbatches of several examples "
                f"(num_microbatches={self.num_microbatches}) are clipped as "
                "one, which ghost norms do not compute"
            )
        reason = _model_state.state_of(self).dp_ghost_blocker
        reason = reason or _ghost_layers.blocker(
            self, variables, trust_code=self.clipping_method == "ghost"
        )
        if not reason:
            whole = _ghost_layers.whole_layers(self, variables)
            alone = ""
            if whole:
                named = ", ".join(
                    f"{layer.name!r} ({type(layer).__name__})"
                    for layer in whole
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
        if self.clipping_method == "ghost":
            raise ValueError(
                "`clipping_method='ghost'` cannot clip this model without "
                f"per-example gradients: {reason}. Received: "
                "clipping_method='ghost'. Use clipping_method='auto' (which "
                "then computes per-example gradients) or 'vectorized'."
            )
        return "vectorized", reason

    def _ghost_clipped_sums(
        self,
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
            self,
            loss_function,
            (loss_function.x, loss_function.y, loss_function.sample_weight),
            variables,
            optimizer,
            ops.cast(self.l2_norm_clip, "float32"),
        )
        if isinstance(found, str):
            if self.clipping_method == "ghost":
                raise ValueError(
                    "`clipping_method='ghost'` cannot clip this model "
                    f"without per-example gradients: {found}. "
                    "Received: clipping_method='ghost'. Use "
                    "clipping_method='auto' or 'vectorized'."
                )
            _model_state.state_of(self).dp_ghost_blocker = found
            return None
        loss, y_pred, clipped = found
        self._note_clipping(loss_function.x, clipped.norms, clipped.mask, None)
        return loss, y_pred, clipped.sums

    def _microbatch_count(self, x: Any) -> int | None:
        """Returns the number of microbatches; `None`: one per example.

        A `num_microbatches` that does not divide a batch of known size is
        refused here; a batch whose size is known only at run time (a
        dataset on TensorFlow) is checked by `split` when it arrives.
        """
        if self.num_microbatches is None:
            return None
        first = next(t for t in keras.tree.flatten(x) if t is not None)
        batch_size = first.shape[0]
        count = self.num_microbatches
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

    def _check_microbatches_divide(self, arguments: dict[str, Any]) -> None:
        """Refuses arrays whose batches `num_microbatches` does not divide.

        Before the first step: the step checks each batch as it arrives,
        which on TensorFlow (a batch of unknown size in the traced step)
        is a graph assertion after a whole epoch. The global batch is
        checked; a replica's share divides only if it does.
        """
        count = self.num_microbatches
        x = arguments.get("x")
        if count is None or not _fit_data.is_arrays(x):
            return
        examples = _fit_data.array_examples(
            x, arguments.get("validation_split")
        )
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

    def _refuse_dynamic_loss_scale(self, optimizer: Optimizer) -> None:
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

    def _refuse_batch_mixing(self) -> None:
        """Raises if a layer mixes the examples of a batch in training."""
        for layer in _keras_compat.all_layers(self):
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
