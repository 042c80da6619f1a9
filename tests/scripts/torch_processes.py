"""custom_fit over torch.distributed processes, against one process.

Launched by `tests/torch_processes_test.py`, as a user launches it:

    python -m torch.distributed.run --nproc_per_node=2 torch_processes.py \
        --output_dir=DIR

Each process (gloo, 127.0.0.1) fits its share of every global batch of
32 (`x[rank::world]`, batches of 16) for each configuration below, from
weights initialized with its own seed; without `torchrun` the script fits
the global batches in one process. Each run saves, per configuration, its
final weights and its `History` to `DIR/<run>.npz` (`process_<rank>` or
`single`), and what differs by process (a dropout mask, the shares of
Poisson draws) to `DIR/<run>_own.npz`. The data has an uneven last
batch (12 + 11 rows); the validation data (37 examples) is sharded the
same way.
"""

import dataclasses
import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import datetime  # noqa: E402

import files_once  # noqa: E402  (tests/scripts/files_once.py)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where to save.")
_ONLY = flags.DEFINE_list("only", None, "Run only these configurations.")
_KILL_RANK = flags.DEFINE_integer(
    "kill_rank", None, "Only fit, and kill this process at its 3rd batch."
)
flags.mark_flag_as_required("output_dir")

SAMPLES = 119  # global batches of 32, 32, 32 and 23
GLOBAL_BATCH = 32
KERAS_3_16 = tuple(int(p) for p in keras.version().split(".")[:2]) >= (3, 16)


class BatchesSeen(keras.callbacks.Callback):
    """Records the batch index of every `on_train_batch_end`."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(batch)


def keras_batches_seen(x, y):
    """The batch indices Keras' own model shows callbacks with 4 steps per
    call, on the global batches (the oracle)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((x.shape[1],))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    seen = BatchesSeen()
    targets = np.zeros((len(x), 3), "float32")
    model.fit(
        x,
        targets,
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[seen],
    )
    return np.asarray(seen.seen)


class Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    pass


class Accumulated(custom_fit.GradientClippingMixin, keras.Model):
    pass


class GradientNoiseMixin(custom_fit.TrainStepMixin):
    """A user's mixin with a seed generator of its own on the model (as in
    examples/gradient_noise.py): its noise acts on the reduced gradients,
    so every process must draw the same."""

    gradient_noise_stddev = custom_fit.options.Option(
        0.0, custom_fit.options.non_negative_float
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise_seeds = keras.random.SeedGenerator(5)

    def transform_gradients(self, gradients, variables):
        gradients = [
            g
            + self.gradient_noise_stddev
            * keras.random.normal(g.shape, seed=self.noise_seeds)
            for g in gradients
        ]
        return super().transform_gradients(gradients, variables)


class Noisy(GradientNoiseMixin, custom_fit.GradientClippingMixin, keras.Model):
    pass


class LikeKeras316(keras.Model):
    """What Keras 3.16's PyTorch trainer adds over a process group: the
    model wrapped in `DistributedDataParallel` (`ddp_model`, set without
    registering a submodule, used by its steps' forward passes) and every
    metric variable summed over the processes in `get_metrics_result`."""

    ddp_model = None

    def wrap(self):
        if torch.distributed.is_initialized() and self.ddp_model is None:
            object.__setattr__(
                self,
                "ddp_model",
                torch.nn.parallel.DistributedDataParallel(
                    self, find_unused_parameters=False
                ),
            )

    def make_predict_function(self, force=False):
        self.wrap()
        return super().make_predict_function(force)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return (self.ddp_model or self)(x, training=False)

    def get_metrics_result(self):
        if not torch.distributed.is_initialized():
            return super().get_metrics_result()
        summed = []
        for variable in self.metrics_variables:
            value = variable.value.clone()
            torch.distributed.all_reduce(value)
            summed.append(value)
        with keras.StatelessScope(
            state_mapping=list(zip(self.metrics_variables, summed))
        ):
            return super().get_metrics_result()


class Wrapped(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    LikeKeras316,
):
    pass


class Sam(custom_fit.SharpnessAwareMixin, keras.Model):
    pass


class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass


class Projected(custom_fit.PCGradMixin, keras.Model):
    pass


def data(samples=SAMPLES, seed=0):
    """Returns `(x, y)`: 119 examples, 6 features, 3 classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1)
    return x, y.astype("int32")


def network(
    model_class, seed, normalized=False, outputs=1, dropout=False, **options
):
    """A small MLP whose weights come from `seed`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    if normalized:
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    if dropout:
        hidden = keras.layers.Dropout(0.5, seed=7, name="dropout")(hidden)
    heads = [
        keras.layers.Dense(3, name=f"logits_{i}")(hidden)
        for i in range(outputs)
    ]
    return model_class(inputs, heads if outputs > 1 else heads[0], **options)


def configurations():
    """Name -> (model builder, compile arguments, fit transform of x)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731

    def plain_sgd():
        return dict(optimizer=sgd(), loss=loss)

    def private(**options):
        """DP-SGD with noise: clip 2.5, noise 1.0, seed 3 (unless given)."""
        options = {"noise_multiplier": 1.0, "noise_seed": 3, **options}
        return lambda seed: network(Private, seed, l2_norm_clip=2.5, **options)

    def nan_in_batch_one(x):
        x = x.copy()
        x[GLOBAL_BATCH + 3, 0] = np.nan  # one row, so one process' shard
        return x

    found = {
        "clipping_inspection_l2": (
            lambda seed: network(
                Net,
                seed,
                global_clipnorm=0.05,
                l2=1e-2,
                layer_norms_in_logs=True,
            ),
            dict(optimizer=adam(), loss=loss, metrics=["accuracy"]),
            None,
        ),
        "guard_spike": (
            lambda seed: network(
                Net,
                seed,
                skip_nonfinite=True,
                skip_gradient_norm_above=0.7,
                global_clipnorm=0.6,
            ),
            dict(optimizer=adam(), loss=loss),
            nan_in_batch_one,
        ),
        "keras_3_16_ddp": (
            # Guarded clipping + inspection on a model wrapped as Keras 3.16
            # wraps it: no second reduction of gradients or logs.
            lambda seed: _wrapped(
                network(
                    Wrapped,
                    seed,
                    global_clipnorm=0.6,
                    skip_nonfinite=True,
                    layer_norms_in_logs=True,
                )
            ),
            dict(optimizer=adam(), loss=loss, metrics=["accuracy"]),
            nan_in_batch_one,
        ),
        "accumulation": (
            lambda seed: network(
                Accumulated,
                seed,
                gradient_accumulation_steps=2,
                global_clipnorm=0.5,
            ),
            dict(optimizer=sgd(), loss=loss),
            None,
        ),
        "sam": (
            lambda seed: network(Sam, seed, sam_rho=0.05),
            dict(optimizer=sgd(), loss=loss),
            None,
        ),
        "pcgrad": (
            lambda seed: network(
                Projected,
                seed,
                outputs=2,
                per_loss_gradients="outputs",
                pcgrad_seed=1,
            ),
            dict(optimizer=sgd(), loss=[loss, loss]),
            None,
        ),
        "parameter_groups": (
            lambda seed: network(Net, seed, global_clipnorm=0.5),
            dict(
                optimizer=custom_fit.MultiOptimizer(
                    [
                        (keras.optimizers.SGD(0.05), "hidden"),
                        (keras.optimizers.Adam(0.01), "logits_0"),
                    ]
                ),
                loss=loss,
            ),
            None,
        ),
        "batch_normalization": (
            lambda seed: network(
                Net, seed, normalized=True, global_clipnorm=0.5
            ),
            dict(optimizer=sgd(), loss=loss),
            None,
        ),
        "dropout": (
            lambda seed: network(Net, seed, dropout=True, global_clipnorm=0.5),
            dict(optimizer=sgd(), loss=loss),
            None,
        ),
        "user_noise": (
            lambda seed: network(
                Noisy, seed, gradient_noise_stddev=0.05, global_clipnorm=1.0
            ),
            dict(optimizer=sgd(), loss=loss),
            None,
        ),
        "dp_ghost": (private(clipping_method="ghost"), plain_sgd(), None),
        "dp_calibrated": (
            # Calibrated for the global run: shuffled batches of 32 of 119
            # examples, which the processes' shards make together.
            private(
                noise_multiplier=custom_fit.privacy.calibrate_noise(
                    target_epsilon=3.0,
                    delta=1e-3,
                    num_examples=SAMPLES,
                    batch_size=GLOBAL_BATCH,
                    epochs=2,
                    sampling="shuffle",
                ),
            ),
            plain_sgd(),
            None,
        ),
        "dp_vectorized": (
            private(clipping_method="vectorized"),
            plain_sgd(),
            None,
        ),
        # A secret seed: each process draws its own, and fit hands process
        # 0's to the others (compared across processes only).
        "dp_secret_seed": (private(noise_seed=None), plain_sgd(), None),
    }
    if KERAS_3_16:
        # Keras 3.16's PyTorch trainer runs several steps per call (a list
        # of batches); refused before 3.16. Guarded clipping + inspection,
        # a NaN in one process' shard; the batch indices the callbacks
        # see are saved too (`fit_extras`).
        found["steps_per_execution_4"] = (
            lambda seed: network(
                Net,
                seed,
                global_clipnorm=0.6,
                skip_nonfinite=True,
                layer_norms_in_logs=True,
            ),
            dict(
                optimizer=adam(),
                loss=loss,
                metrics=["accuracy"],
                steps_per_execution=4,
            ),
            nan_in_batch_one,
        )
    return found


def _wrapped(model):
    model.wrap()
    return model


def fit_extras(name, label):
    """`fit`'s epochs and callbacks: 2 epochs; for the first configuration
    up to 12, stopped by `EarlyStopping` on `val_loss` (every process must
    stop at the same epoch), with `GradientTensorBoard`, `CSVLogger` and
    `ModelCheckpoint` writing to `tb_<label>`, `log_<label>.csv` and
    `checkpoint_<label>.keras` (only the first process writes)."""
    if name == "steps_per_execution_4":
        return {"epochs": 2, "callbacks": [BatchesSeen()]}
    if name != "clipping_inspection_l2":
        return {"epochs": 2}
    return {
        "epochs": 12,
        "callbacks": [
            keras.callbacks.EarlyStopping(
                monitor="val_loss", min_delta=0.01, patience=0
            ),
            custom_fit.callbacks.GradientTensorBoard(
                os.path.join(_OUTPUT_DIR.value, f"tb_{label}")
            ),
            keras.callbacks.CSVLogger(
                os.path.join(_OUTPUT_DIR.value, f"log_{label}.csv")
            ),
            keras.callbacks.ModelCheckpoint(
                os.path.join(_OUTPUT_DIR.value, f"checkpoint_{label}.keras")
            ),
        ],
    }


def unequal_refused(x, y, rank, world):
    """Whether `fit` refuses shares of unequal batch counts before its first
    step (process 0 gets 4 batches of 16, the others 2)."""
    model = network(Net, 0, global_clipnorm=1.0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rows = 64 if rank == 0 else 32
    try:
        model.fit(x[:rows], y[:rows], batch_size=16, epochs=1, verbose=0)
    except ValueError as error:
        assert "training batches per epoch" in str(error), error
        return True
    return False


class _Kill(keras.callbacks.Callback):
    """Ends this process abruptly at its third batch."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2:
            os._exit(3)


def fit_then_die(x, y, rank, world):
    """Fits for 20 epochs; process `--kill_rank` dies at its third batch."""
    model = network(Net, rank, global_clipnorm=1.0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    callbacks = [_Kill()] if rank == _KILL_RANK.value else []
    model.fit(
        x[rank::world],
        y[rank::world],
        batch_size=GLOBAL_BATCH // world,
        epochs=20,
        verbose=0,
        callbacks=callbacks,
    )


def backup_and_restore(x, y, rank, world):
    """A 4-epoch fit with `BackupAndRestore`, interrupted as its third epoch
    begins in every process, then resumed by a new model (its own seed):
    returns the resumed run's final weights and epochs run, and whether the
    backup directory is gone at the end."""
    directory = os.path.join(_OUTPUT_DIR.value, f"backup_{world}")

    def run(seed, callbacks):
        model = network(Net, seed, global_clipnorm=0.5)
        model.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(
            x[rank::world],
            y[rank::world],
            batch_size=GLOBAL_BATCH // world,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(directory)] + callbacks,
        )
        return model, history

    try:
        run(rank, [files_once.Interrupt(2)])
        raise AssertionError("not interrupted")
    except RuntimeError as error:
        assert "interrupted at epoch 2" in str(error), error
    model, history = run(rank + 10, [])
    results = {
        f"backup/weight_{i}": w for i, w in enumerate(model.get_weights())
    }
    results["backup/epochs_run"] = np.float32(len(history.history["loss"]))
    if world > 1:
        torch.distributed.barrier()
    results["backup/removed"] = np.float32(not os.path.exists(directory))
    return results


def poisson_private(x, y, rank, world):
    """DP-SGD (noise 1.0) on a `PoissonSampler` of the whole data with the
    same seed in every process, 3 epochs, epsilon logged by
    `PrivacyBudget`; then the refusals of samplers that differ across
    processes. Returns a dict of results."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def private_model():
        model = network(
            Private,
            rank,
            l2_norm_clip=2.5,
            noise_multiplier=1.0,
            noise_seed=3,
            expected_batch_size=GLOBAL_BATCH,
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    model = private_model()
    budget = custom_fit.callbacks.PrivacyBudget(
        num_examples=SAMPLES, batch_size=GLOBAL_BATCH, delta=1e-3
    )
    sampler = custom_fit.sampling.PoissonSampler(
        x, y, batch_size=GLOBAL_BATCH, seed=5
    )
    # Audited by 200 canaries (drawn and dealt to the processes as examples
    # are): the audit's figures too must equal one process'.
    audit = custom_fit.auditing.CanaryAudit(num_canaries=200, seed=7)
    history = model.fit(
        audit.wrap(sampler), epochs=3, verbose=0, callbacks=[budget, audit]
    )
    results = {
        f"poisson/weight_{i}": w for i, w in enumerate(model.get_weights())
    }
    results["poisson/epsilon"] = np.asarray(history.history["epsilon"])
    results["audit/figures"] = audit_figures(audit)
    # Secret seeds, of the noise and of the sampler: each process draws its
    # own, and fit hands process 0's to the other.
    secret = network(
        Private,
        rank,
        l2_norm_clip=2.5,
        noise_multiplier=1.0,
        expected_batch_size=GLOBAL_BATCH,
    )
    secret.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    # The canaries' membership from the sampler's seed: process 0's.
    audit = custom_fit.auditing.CanaryAudit(num_canaries=200)
    secret.fit(
        audit.wrap(
            custom_fit.sampling.PoissonSampler(x, y, batch_size=GLOBAL_BATCH)
        ),
        epochs=1,
        verbose=0,
        callbacks=[audit],
    )
    for i, weight in enumerate(secret.get_weights()):
        results[f"poisson_secret/weight_{i}"] = weight
    results["audit_secret/figures"] = audit_figures(audit)
    refusals = {
        # Each process' own seed, its own data, shuffling asked for.
        "seed": (dict(x=x, y=y, seed=rank), {}),
        "data": (dict(x=x[rank::world], y=y[rank::world], seed=5), {}),
        "shuffle": (dict(x=x, y=y, seed=5), {"shuffle": True}),
    }
    # A sampler in the first process, arrays (as many batches) in the others.
    refusals["mixed"] = (dict(x=x, y=y, seed=5), {})
    for name, (made, fitted) in refusals.items():
        data = custom_fit.sampling.PoissonSampler(
            batch_size=GLOBAL_BATCH, **made
        )
        if name == "mixed" and rank > 0:
            data, fitted = x[rank::world], {"y": y[rank::world]}
            fitted["batch_size"] = GLOBAL_BATCH // world
        model = private_model()
        if name == "mixed":  # (a private model refuses arrays by itself)
            model = network(Net, rank, global_clipnorm=1.0)
            model.compile(optimizer="sgd", loss=loss)
        try:
            model.fit(data, epochs=1, verbose=0, **fitted)
            refused = False
        except ValueError as error:
            expected = {
                "seed": "samplers whose seed differ",
                "data": "samplers whose data (each process holds",
                "shuffle": "a true shuffle in 2 of 2 processes",
                "mixed": "the same kind of data",
            }[name]
            assert expected in str(error), error
            refused = True
        results[f"refused/poisson_{name}"] = np.float32(refused)
    return results


def audit_figures(audit):
    """Returns the figures of an audited run, and whether every check
    passed."""
    found = audit.result(1e-3)
    fields = dataclasses.asdict(found).values()
    numbers = [v for v in fields if not isinstance(v, dict)]
    return np.asarray([*numbers, found.passed], np.float64)


def poisson_canary():
    """DP-SGD without noise on a `PoissonSampler` of 64 examples that deals
    each draw into 2 batches (`gradient_accumulation_steps=2`), 10 epochs:
    example `i` moves only row `i` of a table, by the clip (1.0) per entry
    in an update. Returns the entries of each example in each update (the
    table's changes times the logical batch), which must be 0 or 1."""
    ids = np.arange(64, dtype="int32")[:, None]
    targets = np.tile(np.asarray([[10.0, 0.0]], "float32"), (64, 1))
    inputs = keras.Input((1,), dtype="int32")
    rows = keras.layers.Embedding(
        64, 2, embeddings_initializer="zeros", name="table"
    )(inputs)
    model = Private(
        inputs,
        keras.layers.Flatten()(rows),
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        gradient_accumulation_steps=2,
        expected_batch_size=16,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    tables = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            tables.append(model.get_layer("table").get_weights()[0])

        def on_train_batch_end(self, batch, logs=None):
            tables.append(model.get_layer("table").get_weights()[0])

    sampler = custom_fit.sampling.PoissonSampler(
        ids, targets, batch_size=8, gradient_accumulation_steps=2
    )
    model.fit(sampler, epochs=10, verbose=0, callbacks=[Record()])
    changes = np.diff(np.asarray(tables, np.float64), axis=0)[..., 0] * 16
    return {"canary/entries": changes[np.abs(changes).max(axis=1) > 1e-6]}


def poisson_shares(epochs=50):
    """Iterates a `PoissonSampler` of 400 examples (expected batch 40) as
    `fit` feeds it, for 500 steps. Returns `(taken, rows)`: which examples
    each step's share of this process holds (its rows of weight 1), and
    the rows of each share (padding included)."""
    ids = np.arange(400, dtype="float32")[:, None]
    sampler = custom_fit.sampling.PoissonSampler(
        ids, np.zeros(400, "int32"), batch_size=40, seed=11
    )
    taken, rows = [], []
    for _ in range(epochs):
        sampler.on_epoch_end()  # Keras ends an epoch before the first one
        for index in range(len(sampler)):
            x, _, weights = sampler[index]
            step = np.zeros(400, bool)
            step[x[weights > 0, 0].astype(int)] = True
            taken.append(step)
            rows.append(len(weights))
    return np.stack(taken), np.asarray(rows)


def main(argv):
    del argv
    world, rank = 1, 0
    if "RANK" in os.environ:
        torch.distributed.init_process_group(
            "gloo", timeout=datetime.timedelta(seconds=120)
        )
        world, rank = (
            torch.distributed.get_world_size(),
            torch.distributed.get_rank(),
        )
    x, y = data()
    if _KILL_RANK.value is not None:
        fit_then_die(x, y, rank, world)
        return
    x_val, y_val = data(samples=37, seed=1)
    label = "single" if world == 1 else f"process_{rank}"
    saved = {}
    own = {}  # results that differ by process
    for name, (build, compile_args, transform) in configurations().items():
        if _ONLY.value and name not in _ONLY.value:
            continue
        model = build(seed=rank)
        model.compile(**compile_args)
        features = x if transform is None else transform(x)
        labels = y if "pcgrad" not in name else (y, y)
        shard = lambda a: a[rank::world]  # noqa: E731
        extras = fit_extras(name, label)
        history = model.fit(
            shard(features),
            keras.tree.map_structure(shard, labels),
            batch_size=GLOBAL_BATCH // world,
            validation_data=(
                shard(x_val),
                keras.tree.map_structure(
                    shard, y_val if "pcgrad" not in name else (y_val, y_val)
                ),
            ),
            shuffle=False,
            verbose=0,
            **extras,
        )
        if name == "steps_per_execution_4":
            saved[f"{name}/batches_seen"] = np.asarray(
                extras["callbacks"][0].seen
            )
            # Every process computes it (on the global batches): the test
            # compares the saved keys of the processes.
            saved[f"{name}/keras_batches_seen"] = keras_batches_seen(x, y)
        for i, weight in enumerate(model.get_weights()):
            saved[f"{name}/weight_{i}"] = weight
        for key, values in history.history.items():
            saved[f"{name}/history/{key}"] = np.asarray(values)
        # Whether Keras' trainer wrapped the model in DistributedDataParallel
        # (3.16 over a process group; the imitation's own wrapping aside).
        own[f"{name}/keras_wrapped"] = np.float32(
            getattr(model, "ddp_model", None) is not None
            and name != "keras_3_16_ddp"
        )
        if name == "keras_3_16_ddp":
            saved[f"{name}/evaluated"] = np.asarray(
                model.evaluate(
                    shard(x_val),
                    shard(y_val),
                    batch_size=GLOBAL_BATCH // world,
                    verbose=0,
                )
            )
            saved[f"{name}/predicted"] = model.predict(x_val, verbose=0)
            saved[f"{name}/wrapped"] = np.float32(model.ddp_model is not None)
        if name == "dropout":
            # The mask each process' dropout draws next (differs by process).
            layer = model.get_layer("dropout")
            own[f"{name}/mask"] = keras.ops.convert_to_numpy(
                layer(np.ones((16, 8), "float32"), training=True)
            )
        print(name, "done", flush=True)
    if not _ONLY.value or "backup" in _ONLY.value:
        saved.update(backup_and_restore(x, y, rank, world))
    if not _ONLY.value or "poisson" in _ONLY.value:
        saved.update(poisson_private(x, y, rank, world))
        saved.update(poisson_canary())
        own["taken"], own["rows"] = poisson_shares()
    np.savez(os.path.join(_OUTPUT_DIR.value, f"{label}_own.npz"), **own)
    saved["refused/unequal"] = np.float32(unequal_refused(x, y, rank, world))
    np.savez(os.path.join(_OUTPUT_DIR.value, f"{label}.npz"), **saved)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    app.run(main)
