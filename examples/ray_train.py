"""Data-parallel training on Ray Train, on any Keras backend.

    pip install "custom_fit[ray]"
    KERAS_BACKEND=tensorflow python examples/ray_train.py --workers=2
    KERAS_BACKEND=jax python examples/ray_train.py --workers=2
    KERAS_BACKEND=torch python examples/ray_train.py --workers=2

Ray starts `--workers` training processes (here on a local Ray cluster; on
a real one, `ray.init(address=...)`), each running `train_loop`, which
fits the MLP on scikit-learn's digits with clipping of the global gradient
norm and per-layer inspection:

- TensorFlow: Ray's `TensorflowTrainer` sets `TF_CONFIG`; the loop trains
  under `MultiWorkerMirroredStrategy` on one dataset of global batches,
  which `tf.distribute` splits between the workers.
- PyTorch: Ray's `TorchTrainer` makes the process group (gloo on CPU); the
  model is not wrapped by Ray's `prepare_model`: custom_fit sums the
  processes' gradients itself, before any mixin sees them.
- JAX: Ray's `JaxTrainer` starts the workers; each joins the JAX cluster
  with `keras.distribution.initialize` (its rank and the number of workers
  from Ray's context) and trains under `keras.distribution.DataParallel`.

On PyTorch and JAX each worker feeds its own rows of every global batch.

`--private` trains with DP-SGD instead: per-example clipping, Gaussian
noise, Poisson-sampled batches (`custom_fit.sampling.PoissonSampler`)
and the epsilon spent logged every epoch (`PrivacyBudget`). Every worker
makes the same sampler of the whole data; `fit` feeds each its share of
every draw, and hands worker 0's secret seeds (the draws', the noise's)
to the others, so that the workers train as one process would, on one
draw per step. PyTorch and JAX only: TensorFlow's
`MultiWorkerMirroredStrategy` would give every worker a sampler of its
own, two draws counted as one, and custom_fit refuses it.
Every epoch the workers report their logs to Ray (`ray.train.report`),
with a checkpoint written by worker 0 (the weights, the optimizer's state,
the epochs done and their logs); `--resume_from=<checkpoint directory>`
continues a run from one, and Ray resumes from the latest itself when it
restarts a failed run. `--workers=1` trains in this process without Ray
(the reference): on the same global batches it ends on the same weights,
with the same logs (with `--private`: given `--seed`, the same weights,
epsilon, clipped fraction and accuracy; the loss log counts each
worker's padding rows and differs).
"""

import contextlib
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import local_cluster  # noqa: E402  (examples/local_cluster.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_WORKERS = flags.DEFINE_integer(
    "workers", 2, "Ray workers (1: train in this process, without Ray)."
)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs, in all.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Global batch.")
_RESUME_FROM = flags.DEFINE_string(
    "resume_from", "", "A checkpoint directory of an earlier run to go on from."
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir",
    "",
    "If set: each worker's final weights, optimizer state and logs "
    "(worker_<rank>/), and Ray's run directory (checkpoints).",
)
_CRASH_AFTER_EPOCH = flags.DEFINE_integer(
    "crash_after_epoch",
    0,
    "If set: worker 0 dies once, after this epoch's checkpoint has reached "
    "Ray, and Ray restarts the run from it (Ray's fault tolerance, to try "
    "it).",
)
_PRIVATE = flags.DEFINE_boolean(
    "private", False, "Train with DP-SGD on Poisson-sampled batches."
)
_SEED = flags.DEFINE_integer(
    "seed",
    None,
    "With --private: the sampler's and the noise's seed. Unset: secret "
    "seeds (a private run); set: a reproducible run, for comparisons.",
)
_PLAIN = flags.DEFINE_boolean(
    "plain", False, "Train a plain keras.Model (no custom_fit mixins)."
)

_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def save_checkpoint(directory, model, history):
    """Writes the weights, the optimizer's variables and the logs so far.

    Enough for this MLP; a model with random layers (dropout) would also
    keep their seed generators' state to resume bit for bit.
    """
    import numpy as np

    np.savez(os.path.join(directory, "weights.npz"), *model.get_weights())
    np.savez(
        os.path.join(directory, "optimizer.npz"),
        *[np.asarray(v) for v in model.optimizer.variables],
    )
    with open(os.path.join(directory, "history.json"), "w") as handle:
        json.dump(history, handle)


def load_checkpoint(directory, model):
    """Restores what `save_checkpoint` wrote; returns the logs so far."""
    import numpy as np

    with np.load(os.path.join(directory, "weights.npz")) as weights:
        model.set_weights([weights[f"arr_{i}"] for i in range(len(weights))])
    model.optimizer.build(model.trainable_variables)
    with np.load(os.path.join(directory, "optimizer.npz")) as state:
        for i, variable in enumerate(model.optimizer.variables):
            variable.assign(state[f"arr_{i}"])
    with open(os.path.join(directory, "history.json")) as handle:
        return json.load(handle)


def train_loop(config):
    """Trains in one Ray worker (or, without Ray, in this process).

    Args:
        config: Dict with `epochs`, `global_batch_size`, `resume_from`,
            `output_dir`, `crash_after_epoch`, `plain`, `private`, `seed`,
            `ray` (whether Ray
            started this process), with Ray `storage` (Ray's run
            directory) and, on JAX, `coordinator` (`host:port` of the JAX
            cluster).
    """
    import keras

    workers, rank = 1, 0
    if config["ray"]:
        import ray.train

        context = ray.train.get_context()
        workers, rank = context.get_world_size(), context.get_world_rank()
    backend = keras.backend.backend()
    strategy = None
    if backend == "jax" and workers > 1:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize(config["coordinator"], workers, rank)
        distribution = keras.distribution.DataParallel(devices=jax.devices())
        distribution.auto_shard_dataset = False  # each feeds its own rows
        keras.distribution.set_distribution(distribution)
    elif backend == "tensorflow":
        import tensorflow as tf

        strategy = (
            tf.distribute.MultiWorkerMirroredStrategy()
            if workers > 1
            else tf.distribute.get_strategy()
        )

    import digits  # examples/digits.py
    import mlp  # examples/mlp.py

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """The MLP with global-norm clipping and inspection."""

    class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
        """The MLP trained with DP-SGD."""

    def build():
        if config["plain"]:
            model = mlp.build(keras.Model, x_train.shape[1])
        elif config["private"]:
            model = mlp.build(
                Private,
                x_train.shape[1],
                l2_norm_clip=1.0,
                noise_multiplier=1.1,
                noise_seed=config["seed"],
                expected_batch_size=global_batch,
            )
        else:
            model = mlp.build(Net, x_train.shape[1], global_clipnorm=0.5)
        # A Poisson batch is padded with rows of sample weight 0 (each
        # worker's share on its own): the accuracy is weighted, over the
        # drawn examples only. (The loss, Keras' mean over a batch's rows,
        # counts the padding rows: its log depends on the worker count.)
        accuracy = {
            "weighted_metrics" if config["private"] else "metrics": ["accuracy"]
        }
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **accuracy,
        )
        return model

    keras.utils.set_random_seed(0)
    (x_train, y_train), _ = digits.load_digits(0)
    global_batch = config["global_batch_size"]

    # The model's and the optimizer's variables are made in the strategy's
    # scope on TensorFlow.
    def scope():
        return strategy.scope() if strategy else contextlib.nullcontext()

    with scope():
        model = build()

    history = {}
    checkpoint = None
    if config["ray"]:
        checkpoint = ray.train.get_checkpoint()  # Ray restarted the run
    resume_from = config["resume_from"]
    if checkpoint is not None:
        with checkpoint.as_directory() as directory, scope():
            history = load_checkpoint(directory, model)
        if rank == 0:
            epochs = len(next(iter(history.values()), []))
            print(
                f"Ray restarted the run from the checkpoint of epoch {epochs}."
            )
            if config["output_dir"]:
                path = os.path.join(config["output_dir"], "restarted_from")
                with open(path, "w") as handle:
                    handle.write(str(epochs))
    elif resume_from:
        with scope():
            history = load_checkpoint(resume_from, model)
    done = len(next(iter(history.values()), []))

    if config["private"]:
        # Every worker makes the same sampler of the whole data; fit feeds
        # each its share of every draw. (Padded to multiples of 8 rows:
        # a few batch shapes to compile, not one per batch size.)
        sampler = custom_fit.sampling.PoissonSampler(
            x_train,
            y_train,
            batch_size=global_batch,
            seed=config["seed"],
            pad_to_multiple_of=8,
        )
        inputs = {"x": sampler}
    elif backend == "tensorflow":
        # One dataset of full global batches; tf.distribute gives each
        # worker its share of every one.
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        data = data.batch(global_batch, drop_remainder=True)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        inputs = {"x": data.with_options(options)}
    else:
        x, y = digits.local_share(x_train, y_train, rank, workers, global_batch)
        inputs = {"x": x, "y": y, "batch_size": global_batch // workers}

    callbacks = []
    if config["private"]:
        callbacks.append(
            custom_fit.callbacks.PrivacyBudget(
                num_examples=len(x_train), batch_size=global_batch, delta=1e-5
            )
        )
    if config["ray"]:

        class ReportToRay(keras.callbacks.Callback):
            """Reports each epoch's logs, with worker 0's checkpoint."""

            def on_epoch_end(self, epoch, logs=None):
                for key, value in (logs or {}).items():
                    history.setdefault(key, []).append(float(value))
                with tempfile.TemporaryDirectory() as directory:
                    checkpoint = None
                    if rank == 0:
                        save_checkpoint(directory, self.model, history)
                        checkpoint = ray.train.Checkpoint.from_directory(
                            directory
                        )
                    # Every worker reports (a barrier); Ray copies the
                    # checkpoint into the run's storage before returning.
                    ray.train.report(
                        {
                            "epoch": epoch + 1,
                            **{k: v[-1] for k, v in history.items()},
                        },
                        checkpoint=checkpoint,
                    )
                crash = config["crash_after_epoch"] == epoch + 1
                if crash and rank == 0:
                    # Once: a run restarted without the checkpoint (one Ray
                    # had not collected) does not die again.
                    marker = os.path.join(config["storage"], "crashed")
                    if not os.path.exists(marker):
                        open(marker, "w").close()
                        # Ray's controller collects reports every 2 s; one
                        # not collected yet dies with its worker.
                        time.sleep(6)
                        os._exit(1)  # as a lost machine would

        callbacks.append(ReportToRay())

    fitted = model.fit(
        **inputs,
        initial_epoch=done,
        epochs=config["epochs"],
        shuffle=False,
        callbacks=callbacks,
        verbose=2 if rank == 0 else 0,
    )
    if not config["ray"]:
        for key, values in fitted.history.items():
            history.setdefault(key, []).extend(float(v) for v in values)
    if config["output_dir"]:
        directory = os.path.join(config["output_dir"], f"worker_{rank}")
        os.makedirs(directory, exist_ok=True)
        save_checkpoint(directory, model, history)
    if rank == 0 and config["private"]:
        print(f"epsilon spent: {history['epsilon'][-1]:.3f} (delta 1e-5)")
    elif rank == 0 and not config["plain"]:
        print(f"gradient norms of the last step: {model.gradient_norms}")


def trainer_for(backend, config, workers, storage):
    """Returns Ray's trainer for `backend`, running `train_loop`."""
    import ray.train

    scaling = ray.train.ScalingConfig(num_workers=workers, use_gpu=False)
    run = ray.train.RunConfig(
        storage_path=storage,
        name="custom_fit",
        # A restart goes on from the latest checkpoint (`train_loop`).
        failure_config=ray.train.FailureConfig(
            max_failures=1 if config["crash_after_epoch"] else 0
        ),
    )
    if backend == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer as Trainer
    elif backend == "torch":
        from ray.train.torch import TorchTrainer as Trainer
    else:
        from ray.train.v2.jax import JaxTrainer as Trainer

        # On CPU Ray's JAX trainer leaves the JAX cluster to the loop; its
        # coordinator is worker 0, here on this machine.
        config["coordinator"] = f"127.0.0.1:{local_cluster.free_ports(1)[0]}"
    return Trainer(
        train_loop,
        train_loop_config=config,
        scaling_config=scaling,
        run_config=run,
    )


def main(argv):
    """Trains with Ray's workers, or in this process (`--workers=1`)."""
    del argv
    import keras

    config = {
        "epochs": _EPOCHS.value,
        "global_batch_size": _GLOBAL_BATCH.value,
        "resume_from": os.path.abspath(_RESUME_FROM.value)
        if _RESUME_FROM.value
        else "",
        "output_dir": os.path.abspath(_OUTPUT_DIR.value)
        if _OUTPUT_DIR.value
        else "",
        "crash_after_epoch": _CRASH_AFTER_EPOCH.value,
        "plain": _PLAIN.value,
        "private": _PRIVATE.value,
        "seed": _SEED.value,
        "ray": _WORKERS.value > 1,
    }
    if config["private"] and (config["plain"] or config["resume_from"]):
        # Resuming a private run is not part of this example (nor of its
        # test): refused rather than left untried.
        raise app.UsageError(
            "--private cannot be combined with --plain or --resume_from."
        )
    if config["private"] and config["crash_after_epoch"]:
        raise app.UsageError(
            "--private cannot be combined with --crash_after_epoch."
        )
    if not config["ray"]:
        train_loop(config)
        return
    import ray

    backend = keras.backend.backend()
    # The workers import examples/digits.py and mlp.py, and train with
    # this process's Keras backend.
    path = os.pathsep.join(
        p for p in (_DIRECTORY, os.environ.get("PYTHONPATH")) if p
    )
    variables = {"PYTHONPATH": path, "KERAS_BACKEND": backend}
    for name in ("OMP_NUM_THREADS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL"):
        if name in os.environ:
            variables[name] = os.environ[name]
    storage = config["output_dir"] or tempfile.mkdtemp(prefix="ray_train_")
    config["storage"] = storage
    ray.init(
        num_cpus=_WORKERS.value + 1,
        include_dashboard=False,
        runtime_env={"env_vars": variables},
    )
    try:
        result = trainer_for(backend, config, _WORKERS.value, storage).fit()
    finally:
        ray.shutdown()
    print(f"final logs: {result.metrics}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint.path}")


if __name__ == "__main__":
    app.run(main)
