"""Where the JAX step's extra time goes on a GPU (a diagnostic).

On the GPT-2 of `gpu_step.py` (JAX, `mixed_bfloat16`), in one process:

- `micro_us`: jitted reductions over arrays of the model's trainable
  shapes (float32, random): the per-variable sums of squares, the same
  by one `segment_sum` over the concatenated elements, with a finiteness
  check, one global sum, a scaling of every array, and an empty call (the
  dispatch cost of the host).
- `hlo`: the compiled train step of each configuration (XLA's dump, the
  largest module compiled by its first `fit`): instructions, fusions,
  custom calls (cuBLAS), copies of the entry computation.
- `transfer`: the first device-to-host read of a `fit` of 4 steps under
  `jax.transfer_guard_device_to_host("disallow_explicit")`, where it is
  made (or "none").
- `wall_ms` and `host_ms`: wall time per step between synchronizing reads
  of the loss, and the time the train function takes to return (its host
  work: dispatch is asynchronous), at `steps_per_execution` 1 and 4.

`--projection=float32` leaves the tied embedding's projection as Keras
computes it when the model is called (see `gpu_step.build_model`).

    python benchmarks/gpu_step_diagnosis.py --output=diagnosis.json
    python benchmarks/gpu_step_diagnosis.py --size=tiny   # a CPU check
"""

import glob
import json
import os
import sys
import tempfile
import time
import traceback

# A new folder per run: a module of an earlier run would hide this one's.
_DUMP = tempfile.mkdtemp(prefix="custom_fit_gpu_step_dump_")
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402

STEPS = 12
CONFIGURATIONS = (
    "keras",
    "TrainStepMixin",
    "clipping",
    "clipping_inspection",
    "guarded_stack",
)


def micro_us(shapes):
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    sizes = [int(np.prod(s)) for s in shapes]
    ids = jnp.asarray(np.repeat(np.arange(len(shapes)), sizes))

    def squares(g):
        return jnp.stack([jnp.sum(jnp.square(a)) for a in g])

    functions = {
        "per_variable_sumsq": squares,
        "concatenated_segment_sumsq": lambda g: jax.ops.segment_sum(
            jnp.square(jnp.concatenate([a.ravel() for a in g])), ids, len(g)
        ),
        "per_variable_sumsq_and_isfinite": lambda g: (
            squares(g),
            jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in g])),
        ),
        "one_global_sumsq": lambda g: sum(jnp.sum(jnp.square(a)) for a in g),
        "scale_all": lambda g: [a * 0.5 for a in g],
        "empty_call": lambda g: g[0].ravel()[0] + 1,
    }
    result = {}
    for name, function in functions.items():
        compiled = jax.jit(function)
        jax.block_until_ready(compiled(arrays))
        start = time.perf_counter()
        for _ in range(30):
            out = compiled(arrays)
        jax.block_until_ready(out)
        result[name] = 1e6 * (time.perf_counter() - start) / 30
    return result


def hlo_counts(before):
    files = [
        f
        for f in glob.glob(_DUMP + "/*after_optimizations.txt")
        if f not in before
    ]
    if not files:
        return None
    path = max(files, key=os.path.getsize)
    text = open(path).read()
    entry = text[text.index("\nENTRY") :]
    lines = [
        line
        for line in entry[: entry.index("\n}\n")].splitlines()[1:]
        if "=" in line
    ]
    return {
        "instructions": len(lines),
        "fusions": sum(" fusion(" in line for line in lines),
        "custom_calls": sum("custom-call(" in line for line in lines),
        "copies": sum(" copy(" in line for line in lines),
    }


def first_transfer(model, x, y, batch):
    try:
        with jax.transfer_guard_device_to_host("disallow_explicit"):
            model.fit(x, y, batch_size=batch, steps_per_epoch=4, verbose=0)
    except Exception as error:  # the guard's error names the transfer
        frames = traceback.extract_tb(error.__traceback__)
        return [
            f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
            for f in frames[-7:]
        ]
    return "none"


def timed(model, x, y, batch, steps_per_execution):
    """Returns (wall ms per step, host ms per step) of one `fit`."""
    host = []
    inner = model.train_function

    def train_function(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        host.append(time.perf_counter() - start)
        return result

    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            if step in (steps_per_execution - 1, STEPS - 1):
                float(logs["loss"])
                marks.append(time.perf_counter())

    model.train_function = train_function
    try:
        model.fit(
            x,
            y,
            batch_size=batch,
            steps_per_epoch=STEPS,
            verbose=0,
            callbacks=[Clock()],
        )
    finally:
        model.train_function = inner
    timed_steps = STEPS - steps_per_execution
    return (
        1e3 * (marks[-1] - marks[0]) / timed_steps,
        1e3 * sum(host[1:]) / timed_steps,
    )


def main(argv):
    flags = dict(a.lstrip("-").split("=", 1) for a in argv if "=" in a)
    size = flags.get("size", "gpt2_6l")
    projection = flags.get("projection", "bfloat16")
    keras.config.set_dtype_policy("mixed_bfloat16")
    x, y, batch = gpu_step.batches(size, STEPS)
    result = {
        "device": str(jax.devices()[0].device_kind),
        "size": size,
        "projection": projection,
    }

    def save():
        if "output" in flags:
            with open(flags["output"], "w") as file:
                json.dump(result, file, indent=1)
        print("RESULT " + json.dumps(result), flush=True)

    models = {}
    for name in CONFIGURATIONS:
        before = set(glob.glob(_DUMP + "/*"))
        models[name, 1] = gpu_step.build_model(size, name, projection)
        models[name, 1].fit(
            x, y, batch_size=batch, steps_per_epoch=2, verbose=0
        )
        result.setdefault("hlo", {})[name] = hlo_counts(before)
        result.setdefault("transfer", {})[name] = first_transfer(
            models[name, 1], x, y, batch
        )
        save()
    shapes = [tuple(v.shape) for v in models["keras", 1].trainable_variables]
    result["micro_us"] = micro_us(shapes)
    save()
    for name in ("keras", "TrainStepMixin", "clipping_inspection"):
        models[name, 4] = gpu_step.build_model(size, name, projection, 4)
        models[name, 4].fit(
            x, y, batch_size=batch, steps_per_epoch=8, verbose=0
        )
    for _ in range(3):
        for (name, spe), model in models.items():
            wall, host = timed(model, x, y, batch, spe)
            key = f"{name}/spe{spe}"
            result.setdefault("wall_ms", {}).setdefault(key, []).append(wall)
            result.setdefault("host_ms", {}).setdefault(key, []).append(host)
        save()


if __name__ == "__main__":
    main(sys.argv[1:])
