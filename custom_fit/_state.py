"""Non-trainable state that each replica writes on its own."""

import tensorflow as tf


def local_variable(initial_value: tf.Tensor, name: str) -> tf.Variable:
    """Returns a non-trainable variable that replicas write without syncing.

    Under `tf.distribute` it is an `ON_READ` variable: each replica assigns
    its own copy, and a read returns the first replica's. Use it for state
    computed from values that are the same on every replica (true
    gradients), created outside any traced function (`tf.init_scope`).

    Args:
        initial_value: Tensor, the initial value (fixes shape and dtype).
        name: String, the variable's name.

    Returns:
        A `tf.Variable`.
    """
    return tf.Variable(
        initial_value,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        name=name,
    )
