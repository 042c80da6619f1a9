"""Non-trainable state that each replica writes on its own."""

import tensorflow as tf


def local_variable(
    initial_value: tf.Tensor | float,
    name: str,
    aggregation: tf.VariableAggregation = (
        tf.VariableAggregation.ONLY_FIRST_REPLICA
    ),
) -> tf.Variable:
    """Returns a non-trainable variable that replicas write without syncing.

    Under `tf.distribute` it is an `ON_READ` variable: each replica assigns
    its own copy. By default a read returns the first replica's: use that
    for state computed from values that are the same on every replica (true
    gradients). With `tf.VariableAggregation.SUM` a read adds the replicas'
    copies, as Keras' metric state does. Create it outside any traced
    function (`tf.init_scope`).

    Args:
        initial_value: Tensor or number, the initial value (fixes shape and
            dtype).
        name: String, the variable's name.
        aggregation: How a read combines the replicas' copies.

    Returns:
        A `tf.Variable`.
    """
    return tf.Variable(
        initial_value,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
        name=name,
    )
