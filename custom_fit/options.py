"""Options and state for your own mixins, declared as custom_fit's own.

A mixin declares each constructor keyword it takes as an `Option` class
attribute. The model then validates it when it is built, refuses it when an
option it needs is missing, lists it in `inspect.signature` and `help()`,
saves it in `get_config()` and `.keras` files, reads it back on loading,
refuses assignments to it, and suggests it for a misspelled keyword. A
schedulable option also takes a `keras.optimizers.schedules` schedule,
read in the step with `model.option_in_step(name)`.

A mixin that keeps figures from step to step declares them as `State`
class attributes: each model gets its own variable, made on every backend
and carried with the step (JAX's step is pure), read and written inside the
step as `self.<name>`; state kept per trained variable (an average of
each gradient) is a `Slots` declaration, optionally saved with the
weights; state whose shape only the step knows (one entry per loss) is a
`Buffers` declaration; a random draw in the step takes its seed from a `Seeds`
declaration (a generator per model, seeded by one of the mixin's options,
carried the same way).

The validators below are what custom_fit's own options use: each is a
callable `(name, value) -> value` that returns the value to store and
raises a `ValueError` naming the argument, the value received and the fix.

Example:

```python
import keras
from keras import ops

import custom_fit
from custom_fit import options


@keras.saving.register_keras_serializable()
class GradientNoiseMixin(custom_fit.TrainStepMixin):
    gradient_noise_stddev = options.Option(
        0.0, options.non_negative_float, schedulable=True)
    gradient_noise_seed = options.Option(None, options.seed_or_none)
    noise_seeds = options.Seeds("gradient_noise_seed")

    def transform_gradients(self, gradients, variables):
        stddev = self.option_in_step("gradient_noise_stddev")
        gradients = [
            g + stddev * keras.random.normal(
                ops.shape(g), seed=self.noise_seeds)
            for g in gradients]
        return super().transform_gradients(gradients, variables)
```
"""

from custom_fit._options import Option
from custom_fit._options import Seeds
from custom_fit._options import State
from custom_fit._slots import Buffers
from custom_fit._slots import Slots
from custom_fit._validation import boolean
from custom_fit._validation import fraction
from custom_fit._validation import names_or_none
from custom_fit._validation import non_negative_float
from custom_fit._validation import one_of
from custom_fit._validation import positive_float
from custom_fit._validation import positive_float_or_none
from custom_fit._validation import positive_int
from custom_fit._validation import positive_int_or_none
from custom_fit._validation import seed_or_none

__all__ = [
    "Buffers",
    "Option",
    "Seeds",
    "Slots",
    "State",
    "boolean",
    "fraction",
    "names_or_none",
    "non_negative_float",
    "one_of",
    "positive_float",
    "positive_float_or_none",
    "positive_int",
    "positive_int_or_none",
    "seed_or_none",
]
