"""Fine-tuning a keras-hub causal language model with LoRA and clipping.

A tiny Gemma causal LM (`keras_hub.models.GemmaCausalLM`) is built from its
constructor: no preset is downloaded, and its random weights stand in for
pretrained ones. LoRA is enabled on its backbone (`enable_lora`: the query
and value projections of each decoder block get trainable low-rank
factors, every other weight is frozen), and the model is fine-tuned on a
synthetic corpus made here: sequences that count up modulo the vocabulary
size, each with its own stride, so that the next token follows from the
two before it.

custom_fit adds what a long fine-tuning run is watched with: the true
global gradient norm is clipped (`global_clipnorm`), steps whose gradients
are not finite are skipped (`skip_nonfinite`), and so are steps whose
norm spikes above 10 times the running average of the applied steps'
(`skip_gradient_norm_ratio_above`; `logs["skipped_spikes"]` counts them),
and the gradient norm of
each decoder block is logged every epoch (`layer_depth=2`: the groups are
the backbone's own layers; `layer_norms_in_logs=True` puts them in `logs`
as `grad_norm/<backbone>/<block>`). The program prints each epoch's loss
and per-block norms, and the tokens the model generates greedily after a
prompt.

    python examples/fine_tune_causal_lm.py --epochs=5

On JAX, `--model_parallel` trains over 8 host devices forced at start-up
(`--xla_force_host_platform_device_count=8`), on a 2x4 mesh `("batch",
"model")` laid out by Gemma's own `GemmaBackbone.get_layout_map`; the
results equal one device's:

    KERAS_BACKEND=jax python examples/fine_tune_causal_lm.py --model_parallel
"""

import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The mesh needs 8 devices; JAX reads XLA_FLAGS once, when it starts, so
# they are forced before Keras (and JAX) are imported.
MESH_SHAPE = (2, 4)
if "--model_parallel" in sys.argv[1:]:
    _OTHER_XLA_FLAGS = re.sub(
        r"--xla_force_host_platform_device_count=\d+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    os.environ["XLA_FLAGS"] = (
        _OTHER_XLA_FLAGS + " --xla_force_host_platform_device_count=8"
    ).strip()

import keras  # noqa: E402

try:
    import keras_hub  # noqa: E402
except ImportError as error:
    raise SystemExit(
        "This example needs keras-hub: python -m pip install -e "
        '".[hub]" (it pulls TensorFlow, through tensorflow-text). '
        f"Received: {error}"
    ) from error
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 5, "Epochs of fine-tuning.")
_SPIKE_RATIO = flags.DEFINE_float(
    "skip_gradient_norm_ratio_above",
    10.0,
    "Skip a step whose gradient norm exceeds this many times the running "
    "average of the applied steps' norms.",
)
_SEQUENCES = flags.DEFINE_integer("sequences", 256, "Training sequences.")
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 16, "Tokens per training sequence."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Global batch size.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 4, "Rank of the LoRA factors.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-2, "Adam step size.")
# Below this tiny model's typical norm (about 0.1), so that clipping bites:
# `clip_rate` is the share of steps it lowered the norm in.
_GLOBAL_CLIPNORM = flags.DEFINE_float(
    "global_clipnorm", 0.05, "Bound on the true global gradient norm."
)
_MODEL_PARALLEL = flags.DEFINE_bool(
    "model_parallel",
    False,
    "JAX only: train on a 2x4 (batch, model) mesh of forced host devices, "
    "laid out by GemmaBackbone.get_layout_map. Write it as --model_parallel.",
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")

VOCABULARY_SIZE = 64
STRIDES = (1, 2, 3, 5)


class FineTuned(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras_hub.models.GemmaCausalLM,
):
    """A keras-hub causal LM whose true gradients are clipped and inspected."""


def counting_corpus(sequences, length, seed):
    """Returns `(x, y)`: sequences that count up modulo the vocabulary.

    Each sequence starts at a random token and moves by one of `STRIDES`;
    `x` holds the token ids and padding mask of the first `length` tokens,
    `y` the next token at each position.
    """
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCABULARY_SIZE, size=(sequences, 1))
    strides = rng.choice(STRIDES, size=(sequences, 1))
    tokens = (starts + strides * np.arange(length + 1)) % VOCABULARY_SIZE
    tokens = tokens.astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((sequences, length), dtype=bool),
    }
    return x, tokens[:, 1:]


def build_backbone():
    """Returns a tiny Gemma backbone, built from its constructor."""
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY_SIZE,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=4,
    )


def model_parallel():
    """Sets a ModelParallel distribution over a 2x4 mesh of host devices."""
    if keras.backend.backend() != "jax":
        raise app.UsageError(
            "--model_parallel needs the JAX backend. Received: "
            f"KERAS_BACKEND={keras.backend.backend()}. Run with "
            "KERAS_BACKEND=jax."
        )
    mesh = keras.distribution.DeviceMesh(
        MESH_SHAPE, ["batch", "model"], keras.distribution.list_devices()
    )
    # keras-hub's own layout of the Gemma weights: kernels split over
    # "model" (and "batch"), as Gemma was trained.
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def main(argv):
    """Builds the LoRA model, fine-tunes it, prints norms and a generation."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    if _MODEL_PARALLEL.value:
        model_parallel()
    backbone = build_backbone()
    backbone.enable_lora(rank=_LORA_RANK.value)
    model = FineTuned(
        backbone=backbone,
        preprocessor=None,  # the corpus is token ids already
        global_clipnorm=_GLOBAL_CLIPNORM.value,
        skip_nonfinite=True,
        # A step whose true gradient norm is more than this many times the
        # running average of the applied steps' norms is skipped too (after
        # a warm-up of applied steps): one bad batch costs one step.
        skip_gradient_norm_ratio_above=_SPIKE_RATIO.value,
        gradient_norm_warmup_steps=5,
        layer_depth=2,
        layer_norms_in_logs=True,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
        sampler="greedy",
    )
    x, y = counting_corpus(
        _SEQUENCES.value, _SEQUENCE_LENGTH.value, _SEED.value
    )
    history = model.fit(
        x,
        y,
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        shuffle=False,
        verbose=0,
    )
    # The groups of `layer_depth=2`: "<backbone>/<decoder block>".
    blocks = [
        f"{backbone.name}/{layer.name}" for layer in backbone.transformer_layers
    ]
    for epoch in range(_EPOCHS.value):
        logs = {name: values[epoch] for name, values in history.history.items()}
        norms = ", ".join(
            f"{name}={logs['grad_norm/' + name]:.4f}" for name in blocks
        )
        print(f"epoch {epoch + 1}: loss={logs['loss']:.4f}, {norms}")
    for name, values in history.history.items():
        print(f"{name}: {values[-1]:.6g}")
    print(f"trainable variables: {len(model.trainable_variables)}")
    if _MODEL_PARALLEL.value:
        (query,) = [
            v
            for v in backbone.weights
            if v.path == "decoder_block_0/attention/query/kernel"
        ]
        print(f"devices: {len(keras.distribution.list_devices())}")
        # A JAX array's sharding: how the kernel is split over the mesh.
        print(f"layout of {query.path}: {query.value.sharding.spec}")
    # Two prompts (the mesh splits every batch in two): their first 4
    # tokens, then what the model generates.
    prompt, _ = counting_corpus(2, _SEQUENCE_LENGTH.value, _SEED.value + 1)
    prompt["padding_mask"][:, 4:] = False
    generated = model.generate(
        prompt, max_length=_SEQUENCE_LENGTH.value, stop_token_ids=None
    )
    print(f"prompt: {prompt['token_ids'][0, :4].tolist()}")
    print(f"generated: {np.asarray(generated['token_ids'])[0].tolist()}")


if __name__ == "__main__":
    app.run(main)
