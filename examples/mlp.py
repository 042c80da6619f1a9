"""The multi-layer perceptron that the examples share.

Dense 64 (ReLU) - Dense 64 (ReLU) - Dense 10 (logits): 784-64-64-10 on
MNIST, 64-64-64-10 on scikit-learn's 8x8 digits.
"""

import keras

LAYER_NAMES = ("dense_1", "dense_2", "predictions")


def build(model_class, features, **model_kwargs):
    """Returns the MLP as a functional `model_class` instance.

    Args:
        model_class: `keras.Model` or a custom_fit model class.
        features: Integer, the number of input features (pixels).
        **model_kwargs: Keywords for `model_class` (custom_fit options).

    Returns:
        The model, with layers named as in `LAYER_NAMES`.
    """
    inputs = keras.Input(shape=(features,), name="pixels")
    x = keras.layers.Dense(64, activation="relu", name=LAYER_NAMES[0])(inputs)
    x = keras.layers.Dense(64, activation="relu", name=LAYER_NAMES[1])(x)
    outputs = keras.layers.Dense(10, name=LAYER_NAMES[2])(x)
    return model_class(inputs, outputs, **model_kwargs)
