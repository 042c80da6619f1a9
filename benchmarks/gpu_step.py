"""Step time of custom_fit against plain Keras on a model that fills a GPU.

A keras-hub GPT-2 backbone built from its constructor (no download; by
default 6 layers, hidden 768, 12 heads, the GPT-2 vocabulary of 50,257
tokens, sequences of 256 tokens, batch 16), its logits from the tied token
embedding (projected in bfloat16, see `build_model`), trained with `fit` under
the `mixed_bfloat16` policy on synthetic token ids. Every backend in
`--backends` (JAX and PyTorch by default) runs in a child process of its
own (`KERAS_BACKEND` is fixed at import); each configuration is built,
compiled and warmed up once, then timed in interleaved rounds whose order
rotates, one `fit` call per round.
A callback marks the end of the first and of the last step of each round,
after reading the step's loss (which waits for the device), so `fit`'s
set-up and the first step's dispatch are not counted. Reported per
configuration: the median wall time per step, the median of the paired
ratios to plain Keras timed in the same round, and the configuration's
peak device memory (the backend's allocator, read after its own rounds).
The row `keras_again`, a second plain Keras model, is the run's noise.

    python benchmarks/gpu_step.py --backends=jax,torch --output=gpu.json

`--size=tiny` runs the same code on a model small enough for a CPU (a
check of the script, not a measurement).
"""

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONFIGURATIONS = (
    "keras",
    "keras_again",
    "keras_global_clipnorm",
    "TrainStepMixin",
    "clipping",
    "clipping_inspection",
    "guarded_stack",
    "private_ghost",
    "private",
)
SIZES = {
    # name -> (layers, heads, hidden, intermediate, vocabulary, length, batch)
    "gpt2_6l": (6, 12, 768, 3072, 50257, 256, 16),
    "tiny": (2, 2, 32, 64, 500, 16, 4),
}


def _options(name):
    """Returns (mixin names, mixin keywords, optimizer keywords)."""
    clip = {"global_clipnorm": 1.0}
    return {
        "keras": ((), {}, {}),
        "keras_again": ((), {}, {}),
        "keras_global_clipnorm": ((), {}, clip),
        "TrainStepMixin": (("TrainStepMixin",), {}, {}),
        "clipping": (("GradientClippingMixin",), clip, {}),
        "clipping_inspection": (
            ("GradientClippingMixin", "GradientInspectionMixin"),
            {**clip, "inspect_every": 1},
            {},
        ),
        "guarded_stack": (
            (
                "GradientClippingMixin",
                "GradientInspectionMixin",
                "RegularizationMixin",
            ),
            {
                **clip,
                "l2": 1e-4,
                "skip_nonfinite": True,
                "skip_gradient_norm_ratio_above": 10.0,
            },
            {},
        ),
        # The default clipping method: keras-hub's decoder blocks call
        # their layers from code Keras did not write, so `auto` takes the
        # whole model's per-example gradients.
        "private": (
            ("DifferentialPrivacyMixin",),
            {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "noise_seed": 0},
            {},
        ),
        # Ghost clipping, trusting that code: ghost norms for the Dense and
        # attention layers, per-example gradients of the layer norms and
        # the embeddings alone.
        "private_ghost": (
            ("DifferentialPrivacyMixin",),
            {
                "l2_norm_clip": 1.0,
                "noise_multiplier": 1.1,
                "noise_seed": 0,
                "clipping_method": "ghost",
            },
            {},
        ),
    }[name]


class _Clock:
    """Marks the end of the first and last step of each `fit` call."""

    def __init__(self, keras):
        clock = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch in (0, clock.last):
                    float(logs["loss"])  # waits for the step to finish
                    clock.marks.append(time.perf_counter())

        self.callback = Callback()
        self.marks = []
        self.last = 0


def batches(size, steps):
    """Returns `(x, y, batch_size)`: `steps` batches of synthetic tokens."""
    import numpy as np

    _, _, _, _, vocabulary, length, batch = SIZES[size]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocabulary, (batch * steps, length + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((batch * steps, length), "int32"),
    }
    return x, tokens[:, 1:].astype("int32"), batch


def build_model(size, name, projection="bfloat16", steps_per_execution=1):
    """Returns the compiled GPT-2 of configuration `name`.

    Keras' JAX trainer calls `model.call` itself, so the model's own
    autocast scope is never entered and the tied embedding (an
    `Embedding`, `autocast=False`) casts its weights to bfloat16 when the
    top model calls it; custom_fit calls the model as Keras' TensorFlow and
    PyTorch trainers do, and there the projection runs in float32 (3 of
    the 16 ms of a step on an H200). `projection="bfloat16"` sets the
    embedding's `reverse_dtype`, so that every run computes the same
    thing; `"float32"` leaves it as the call computes it.
    """
    import keras
    import keras_hub

    import custom_fit

    layers, heads, hidden, intermediate, vocabulary, length, _ = SIZES[size]
    mixins, mixin_options, optimizer_options = _options(name)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=length,
    )
    if projection == "bfloat16":
        backbone.token_embedding.reverse_dtype = "bfloat16"
    inputs = {
        key: keras.Input((length,), dtype="int32", name=key)
        for key in ("token_ids", "padding_mask")
    }
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    bases = tuple(getattr(custom_fit, m) for m in mixins)
    model_class = type(name, (*bases, keras.Model), {})
    model = model_class(inputs, logits, **mixin_options)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4, **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model


def child(size, names, steps, rounds, warmup):
    """Measures the configurations on this process's backend."""
    import keras

    backend = keras.backend.backend()
    keras.config.set_dtype_policy("mixed_bfloat16")
    x, y, batch = batches(size, steps)

    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    memory = {}

    def report():
        # Printed after every phase: a run cut short still leaves figures.
        result = {
            "backend": backend,
            "device": _device_name(backend),
            "size": size,
            "build_and_warmup_s": dict(built),
            "ms_per_step": {
                n: 1e3 * statistics.median(t) for n, t in times.items() if t
            },
            "ratio": {n: statistics.median(r) for n, r in ratios.items() if r},
            "ratios": ratios,
            "peak_memory_gb": memory,
            "failed": failed,
        }
        print("RESULT " + json.dumps(result), flush=True)

    clock = _Clock(keras)
    models, built, failed = {}, [], {}
    for name in names:
        try:
            start = time.perf_counter()
            models[name] = build_model(size, name)
            models[name].fit(
                x, y, batch_size=batch, steps_per_epoch=warmup, verbose=0
            )
            built.append((name, time.perf_counter() - start))
        except Exception as error:  # reported, the others still run
            failed[name] = f"{type(error).__name__}: {error}"[:600]
            models.pop(name, None)
        print(f"[{backend}] built {name}", file=sys.stderr, flush=True)
        report()

    def one_round(name):
        clock.marks.clear()
        clock.last = steps - 1
        models[name].fit(
            x,
            y,
            batch_size=batch,
            steps_per_epoch=steps,
            verbose=0,
            callbacks=[clock.callback],
        )
        first, last = clock.marks
        return (last - first) / (steps - 1)

    order = list(models)
    for r in range(rounds):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        this_round = {name: one_round(name) for name in rotated}
        for name, seconds in this_round.items():
            times[name].append(seconds)
            if "keras" in this_round:
                ratios[name].append(seconds / this_round["keras"])
        print(f"[{backend}] round {r}", file=sys.stderr, flush=True)
        report()
    memory.update(_peak_memory(backend, models, one_round))
    report()


def _device_name(backend):
    if backend == "jax":
        import jax

        return str(jax.devices()[0].device_kind)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def _peak_memory(backend, models, one_round):
    """Returns each model's peak device memory (GB) over one more round."""
    peaks = {}
    for name in models:
        if backend == "torch":
            import torch

            if not torch.cuda.is_available():
                return {}
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            one_round(name)
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        else:
            # JAX's allocator keeps one process-wide peak: not per model.
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                peaks["all"] = stats["peak_bytes_in_use"] / 2**30
            return peaks
    return peaks


def main(argv):
    flags = dict(a.lstrip("-").split("=", 1) for a in argv if "=" in a)
    size = flags.get("size", "gpt2_6l")
    names = flags.get("configurations", ",".join(CONFIGURATIONS)).split(",")
    steps = int(flags.get("steps", 20))
    rounds = int(flags.get("rounds", 3))
    warmup = int(flags.get("warmup", 3))
    if "child" in flags:
        child(size, names, steps, rounds, warmup)
        return
    results = []
    for backend in flags.get("backends", "jax,torch").split(","):
        environment = dict(os.environ, KERAS_BACKEND=backend)
        command = [sys.executable, __file__, "--child=1"] + [
            f"--{k}={v}" for k, v in flags.items() if k != "backends"
        ]
        try:
            run = subprocess.run(
                command,
                env=environment,
                stdout=subprocess.PIPE,
                text=True,
                timeout=float(flags.get("timeout", 1800)),
            )
            output = run.stdout
        except subprocess.TimeoutExpired as error:
            output = error.stdout or ""
            output = output if isinstance(output, str) else output.decode()
            print(f"{backend}: timed out", flush=True)
        lines = [
            line[len("RESULT ") :]
            for line in output.splitlines()
            if line.startswith("RESULT ")
        ]
        if not lines:
            print(f"{backend}: no result", flush=True)
            continue
        results.append(json.loads(lines[-1]))
        if "output" in flags:
            with open(flags["output"], "w") as file:
                json.dump(results, file, indent=1)
    for result in results:
        print(_table(result), flush=True)


def _table(result):
    rows = [
        f"{result['backend']} on {result['device']}, {result['size']}",
        "",
        "| configuration | ms per step | ratio to Keras | peak GB | first "
        "fit (s) |",
        "|---|---|---|---|---|",
    ]
    for name, first in result["build_and_warmup_s"].items():
        ms = result["ms_per_step"].get(name, float("nan"))
        ratio = result["ratio"].get(name, float("nan"))
        peak = result["peak_memory_gb"].get(name)
        peak = f"{peak:.2f}" if peak is not None else ""
        rows.append(
            f"| {name} | {ms:.2f} | {ratio:.3f} | {peak} | {first:.1f} |"
        )
    for name, error in result["failed"].items():
        rows.append(f"| {name} | failed: {error} | | | |")
    if "all" in result["peak_memory_gb"]:
        peak = result["peak_memory_gb"]["all"]
        rows.append(f"peak of the process: {peak:.2f} GB")
    return "\n".join(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
