"""What custom_fit adds to the compiled JAX step, in HLO.

For plain Keras, custom_fit configurations and a hand-written jitted step
(global clipping, per-layer norms, a non-finite check), each in a child
process that XLA dumps its optimized HLO from, counts in the train step's
module (the largest one compiled) the instructions of its entry
computation, the fusions among them, the reductions (`reduce` ops,
inside fusions too) and the step's outputs (the entry's result tuple).
The seed MLP 784-64-64-10 at batch 64, Adam. Counts
are noise-free: they do not depend on the machine's load.

    python benchmarks/step_hlo.py
"""

import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONFIGURATIONS = (
    "keras",
    "TrainStepMixin",
    "clipping",
    "clipping_inspection",
    "clipping_inspection_skip",
    "clipping_inspection_guard",
    "hand_written",
)


def run_child(name):
    """Builds the configuration and runs one compiled step (in a child)."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    import custom_fit

    class StepOnly(custom_fit.TrainStepMixin, keras.Model):
        pass

    class Clipped(custom_fit.GradientClippingMixin, keras.Model):
        pass

    class ClippedInspected(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        pass

    options = {
        "keras": (keras.Model, {}),
        "TrainStepMixin": (StepOnly, {}),
        "clipping": (Clipped, {"global_clipnorm": 1.0}),
        "clipping_inspection": (ClippedInspected, {"global_clipnorm": 1.0}),
        "clipping_inspection_skip": (
            ClippedInspected,
            {"global_clipnorm": 1.0, "skip_nonfinite": True},
        ),
        "clipping_inspection_guard": (
            ClippedInspected,
            {
                "global_clipnorm": 1.0,
                "skip_nonfinite": True,
                "skip_gradient_norm_ratio_above": 10.0,
            },
        ),
        "hand_written": (keras.Model, {}),
    }
    model_class, kwargs = options[name]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    model = model_class(inputs, keras.layers.Dense(10)(x), **kwargs)
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 784), "float32"), rng.integers(0, 10, 64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name != "hand_written":
        model.compile(optimizer="adam", loss=loss_fn, jit_compile=True)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        return
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)

    def loss_of(trainable, non_trainable):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return loss_fn(y, y_pred), non_trainable

    @jax.jit
    def train_step(trainable, non_trainable, optimizer_values):
        (loss, non_trainable), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(trainable, non_trainable)
        squares = jnp.stack([jnp.sum(jnp.square(g)) for g in grads])
        norm = jnp.sqrt(jnp.sum(squares))
        layer_norms = jnp.sqrt(squares.reshape(-1, 2).sum(axis=1))
        finite = jnp.isfinite(norm)
        factor = jnp.where(norm > 1.0, 1.0 / norm, 1.0)
        grads = [g * factor for g in grads]
        trainable_new, optimizer_new = optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        trainable_new = [
            jnp.where(finite, new, old)
            for new, old in zip(trainable_new, trainable)
        ]
        return loss, layer_norms, trainable_new, non_trainable, optimizer_new

    train_step(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )


def counts(text):
    """(instructions of the entry, fusions, reductions, outputs)."""
    entry = text[text.index("ENTRY") :]
    entry = entry[: entry.index("\n}") if "\n}" in entry else len(entry)]
    instructions = [line for line in entry.splitlines() if " = " in line]
    fusions = sum(" fusion(" in line for line in instructions)
    reductions = len(re.findall(r" reduce\(", text))
    root = next(line for line in instructions if "ROOT " in line)
    operands = root[root.rindex(" tuple(") + len(" tuple(") :]
    outputs = operands.count(",") + 1 if operands.strip(") ") else 0
    return len(instructions), fusions, reductions, outputs


def measure(name):
    """Runs the child with an HLO dump; returns the train step's counts."""
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "KERAS_BACKEND": "jax",
            "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
        }
        subprocess.run(
            [sys.executable, __file__, "--child", name],
            env=env,
            check=True,
            timeout=600,
        )
        texts = [
            open(path, encoding="utf-8").read()
            for path in glob.glob(
                os.path.join(dump, "*after_optimizations.txt")
            )
        ]
    return counts(max(texts, key=len))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        run_child(sys.argv[2])
        return
    print(
        "| step (JAX, seed MLP, Adam) | instructions | fusions | reductions "
        "| outputs |"
    )
    print("|---|---|---|---|---|")
    for name in CONFIGURATIONS:
        instructions, fusions, reductions, outputs = measure(name)
        print(
            f"| {name} | {instructions} | {fusions} | {reductions} "
            f"| {outputs} |"
        )


if __name__ == "__main__":
    main()
