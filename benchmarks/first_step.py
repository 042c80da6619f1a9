"""Time to the first steps, and peak memory, of custom_fit against Keras.

Each (workload, configuration) runs in a fresh child process on JAX: it
builds the model, then times the first `fit` call (trace, compile, four
steps), then a second `fit` call on a new batch size (a new trace and
compile), and reports its peak resident memory. Workloads: the seed MLP
784-64-64-10 at batch 64, and a keras-hub GPT-2 causal LM built from its
constructor (4 layers, hidden 128, sequences of 64 tokens, batch 8; needs
keras-hub). Configurations: plain Keras, `TrainStepMixin`, and clipping +
inspection + the guard; `private_ghost` (DP-SGD by ghost clipping) on
request.

    KERAS_BACKEND=jax python benchmarks/first_step.py --workloads=mlp,gpt2
    KERAS_BACKEND=jax python benchmarks/first_step.py \
        --configurations=keras,private_ghost
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "jax")

CONFIGURATIONS = ("keras", "TrainStepMixin", "clipping_inspection_guard")
OPTIONAL = ("private_ghost",)


def child(workload, name):
    """Measures one configuration; prints a JSON line."""
    import keras
    import numpy as np

    import custom_fit

    class StepOnly(custom_fit.TrainStepMixin, keras.Model):
        pass

    class Guarded(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        pass

    class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
        pass

    options = {
        "keras": {},
        "TrainStepMixin": {},
        "clipping_inspection_guard": {
            "global_clipnorm": 1.0,
            "skip_nonfinite": True,
            "skip_gradient_norm_ratio_above": 10.0,
        },
        "private_ghost": {
            "l2_norm_clip": 1.0,
            "noise_multiplier": 1.1,
            "noise_seed": 0,
            "clipping_method": "ghost",
        },
    }[name]
    model_class = {
        "keras": keras.Model,
        "TrainStepMixin": StepOnly,
        "clipping_inspection_guard": Guarded,
        "private_ghost": Private,
    }[name]
    rng = np.random.default_rng(0)
    if workload == "mlp":
        keras.utils.set_random_seed(0)
        inputs = keras.Input((784,))
        x = keras.layers.Dense(64, activation="relu")(inputs)
        x = keras.layers.Dense(64, activation="relu")(x)
        model = model_class(inputs, keras.layers.Dense(10)(x), **options)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        x, y = rng.random((512, 784), "float32"), rng.integers(0, 10, 512)
        batches = (64, 48)
        data = (x, y)
    else:
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=1000,
            num_layers=4,
            num_heads=4,
            hidden_dim=128,
            intermediate_dim=512,
            max_sequence_length=64,
        )
        mixins = {
            "keras": (),
            "TrainStepMixin": (custom_fit.TrainStepMixin,),
            "clipping_inspection_guard": (
                custom_fit.GradientClippingMixin,
                custom_fit.GradientInspectionMixin,
            ),
            "private_ghost": (custom_fit.DifferentialPrivacyMixin,),
        }[name]
        task_class = type("Task", (*mixins, keras_hub.models.GPT2CausalLM), {})
        model = task_class(backbone=backbone, preprocessor=None, **options)
        model.compile(optimizer="adam")
        tokens = rng.integers(0, 1000, (64, 64))
        data = (
            {"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)},
            tokens,
        )
        batches = (8, 4)
    timings = []
    for batch in batches:
        start = time.perf_counter()
        model.fit(*data, batch_size=batch, steps_per_epoch=4, verbose=0)
        timings.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps({"first": timings[0], "new_shape": timings[1], "rss": peak})
    )


def measure(workload, name, repeats):
    """Runs `repeats` fresh children; returns their medians."""
    runs = []
    for _ in range(repeats):
        output = subprocess.run(
            [sys.executable, __file__, "--child", workload, name],
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        ).stdout
        runs.append(json.loads(output.strip().splitlines()[-1]))
    return {
        key: statistics.median(run[key] for run in runs)
        for key in ("first", "new_shape", "rss")
    }


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    workloads = ["mlp"]
    repeats = 3
    names = CONFIGURATIONS
    for argument in sys.argv[1:]:
        if argument.startswith("--workloads="):
            workloads = argument.split("=", 1)[1].split(",")
        if argument.startswith("--repeats="):
            repeats = int(argument.split("=", 1)[1])
        if argument.startswith("--configurations="):
            names = tuple(argument.split("=", 1)[1].split(","))
            unknown = set(names) - set(CONFIGURATIONS + OPTIONAL)
            if unknown or names[0] != "keras":
                raise SystemExit(
                    "--configurations must start with keras and name only "
                    f"{CONFIGURATIONS + OPTIONAL}. Received: {names}"
                )
    print(
        "| workload | configuration | first fit (s) | x keras | new batch "
        "size (s) | x keras | peak RSS (MB) | x keras |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in workloads:
        base = None
        for name in names:
            result = measure(workload, name, repeats)
            base = base or result
            print(
                f"| {workload} | {name} | {result['first']:.2f} | "
                f"{result['first'] / base['first']:.2f} | "
                f"{result['new_shape']:.2f} | "
                f"{result['new_shape'] / base['new_shape']:.2f} | "
                f"{result['rss']:.0f} | {result['rss'] / base['rss']:.2f} |"
            )


if __name__ == "__main__":
    main()
