"""`custom_fit.auditing.CanaryAudit`: a private run audited by its canaries.

Oracles: what the DP-SGD mechanism is by definition (the noise's standard
deviation is `noise_multiplier * l2_norm_clip` on every coordinate and
independent across updates; a canary of norm 10 C adds exactly C to an
update it takes part in; an included canary takes part in a draw with the
sampler's rate), a run with the noise taken out (the slot's values are
then exact), and the same run without an audit (the model's training is
unchanged). Faults are put into the step through the public functions it
calls (`custom_fit.privacy.accounting`'s `add_noise` and `clip_factors`)
or into the sampler's draws, and each must be flagged by its named check.
"""

import math
from unittest import mock

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from custom_fit import auditing
from custom_fit import sampling
from custom_fit.privacy import accounting
from tests import testing

SAMPLES = 256
BATCH = 32
CANARIES = 400
DELTA = 1e-5


class Private(custom_fit.DifferentialPrivacyMixin, keras.Model):
    pass


class Plain(custom_fit.GradientClippingMixin, keras.Model):
    pass


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    return x, y


def _model(
    cls=Private,
    layer_norm=False,
    accumulation=None,
    regularized=False,
    **options,
):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    # A weight penalty (in `model.losses`): every example's gradient has a
    # part from it, no canary row's.
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer="l2" if regularized else None
    )(inputs)
    if layer_norm:  # per-example gradients of the whole model
        hidden = keras.layers.LayerNormalization()(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    if cls is Private:
        options = {
            "l2_norm_clip": 1.0,
            "noise_multiplier": 1.0,
            "noise_seed": 3,
            "expected_batch_size": BATCH * (accumulation or 1),
            "gradient_accumulation_steps": accumulation,
            "clipping_method": "vectorized" if layer_norm else "auto",
            **options,
        }
    return cls(inputs, outputs, **options)


def _sampler(accumulation=1):
    x, y = _data()
    return sampling.PoissonSampler(
        x,
        y,
        batch_size=BATCH,
        seed=5,
        pad_to_multiple_of=64,
        gradient_accumulation_steps=accumulation,
    )


def _audited_fit(
    model=None, accumulation=None, steps_per_execution=1, epochs=2, **audit
):
    """Fits `model` (a private one by default) on an audited sampler."""
    model = model or _model(accumulation=accumulation)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    audit = auditing.CanaryAudit(
        num_canaries=audit.pop("num_canaries", CANARIES), seed=7, **audit
    )
    model.fit(
        audit.wrap(_sampler(accumulation or 1)),
        epochs=epochs,
        callbacks=[audit],
        verbose=0,
    )
    return model, audit


def _noise_scaled(factor):
    real = accounting.add_noise
    return lambda tensors, stddev, seeds: real(tensors, stddev * factor, seeds)


def _noise_left_off_the_last(tensors, stddev, seeds, real=accounting.add_noise):
    noisy = real(tensors, stddev, seeds)
    return [*noisy[:-1], tensors[-1]]


def _noise_repeated(tensors, stddev, seeds, real=accounting.add_noise):
    # The generator is put back after each draw: every update, the same.
    before = keras.ops.copy(seeds.state.value)
    noisy = real(tensors, stddev, seeds)
    seeds.state.assign(before)
    return noisy


def _unclipped(norms, l2_norm_clip, mask=None, real=accounting.clip_factors):
    return real(norms, 1e30, mask)


def _counted_twice(sampler_parts):
    # The draw's first batch is dealt into the second batch too: its
    # examples (and canaries) are in the update twice.
    def parts(self, epoch, index):
        first, second = sampler_parts(self, epoch, index)
        return [first, np.sort(np.concatenate([second, first]))]

    return parts


class _Replay(sampling.PoissonSampler):
    """A plain sampler whose draws are an audited sampler's examples."""

    def __init__(self, sampler, audit):
        self.__dict__.update(vars(sampler))
        self.audit, self.num_canaries = audit, audit.num_canaries

    included = auditing.CanarySampler.included

    def draw(self, epoch, number):
        chosen = auditing.CanarySampler.draw(self, epoch, number)
        return chosen[chosen < self.num_examples]


class CanaryAuditTest(testing.TestCase):
    @parameterized.named_parameters(
        ("ghost", {}),
        ("regularized", {"kernel_regularizer": True}),
        ("vectorized", {"layer_norm": True}),
        ("accumulation", {"accumulation": 2}),
        ("steps_per_execution", {"steps_per_execution": 4}),
    )
    def test_a_correct_run_passes_every_check(self, case):
        """Ghost clipping, per-example gradients of the whole model, 2
        batches per update and 4 steps per call: the noise's standard
        deviation is the claimed one, a canary adds one clip bound per
        update it takes part in, the noise does not repeat, included
        canaries take part at the sampler's rate and left-out ones never,
        and the lower bound stays below the accountant's epsilon."""
        if (
            case.get("steps_per_execution", 1) > 1
            and testing.BACKEND == "torch"
        ):
            self.skipTest("PyTorch runs one batch per call")
        model = _model(
            layer_norm=case.get("layer_norm", False),
            accumulation=case.get("accumulation"),
            regularized=case.get("kernel_regularizer", False),
        )
        _, audit = _audited_fit(
            model,
            accumulation=case.get("accumulation"),
            steps_per_execution=case.get("steps_per_execution", 1),
        )
        found = audit.check(DELTA)
        self.assertTrue(found.passed, str(found))
        self.assertEqual(found.updates, 16 // (case.get("accumulation") or 1))
        self.assertEqual(found.canaries_in + found.canaries_out, CANARIES)
        self.assertEqual(found.out_canaries_seen, 0)
        self.assertAllClose(found.noise_ratio, 1.0, atol=0.05)
        self.assertAllClose(found.sensitivity, 1.0, atol=0.25)
        self.assertLess(found.epsilon_lower_bound, found.epsilon_claimed)
        self.assertIn("passed", str(found))

    def test_noise_missing_on_a_variable_is_flagged_and_shows_the_sums(self):
        """A fault: the noise left off one variable (the slot's). The noise
        check fails, and `check` raises naming it; without noise the
        slot's value in an update is the clip bound times the canary's
        rows: exactly 1 per participation (a canary moves the noise-free
        sum by the clip bound, once)."""
        with mock.patch.object(
            accounting, "add_noise", _noise_left_off_the_last
        ):
            _, audit = _audited_fit()
        with self.assertRaisesRegex(auditing.PrivacyAuditError, "noise"):
            audit.check(DELTA)
        found = audit.result(DELTA)
        self.assertIn("noise", found.failures)
        self.assertEqual(
            found.failures.get("independence"),
            "no noise measured: none to test",
        )
        self.assertTrue(found.checks["sensitivity"])
        self.assertTrue(found.checks["sampling"])
        self.assertAllClose(found.sensitivity, 1.0, atol=1e-5, rtol=0)
        self.assertAllClose(found.noise_stddev, 0.0, atol=1e-6)

    def test_the_audit_leaves_the_models_training_as_it_was(self):
        """Noise off: the audited fit ends on the weights of a fit without
        the audit on the same examples' batches (a sampler that draws what
        the audited one draws, canaries left out): the canaries reach only
        the slot."""
        with mock.patch.object(
            accounting, "add_noise", lambda tensors, stddev, seeds: tensors
        ):
            audited, audit = _audited_fit()
            plain = _model()
            plain.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
            plain.fit(_Replay(_sampler(), audit), epochs=2, verbose=0)
        for got, want in zip(audited.get_weights(), plain.get_weights()):
            self.assertAllClose(got, want, atol=1e-6, rtol=0)

    @parameterized.named_parameters(
        ("noise_quartered", "noise", {"add_noise": _noise_scaled(0.25)}),
        (
            "noise_over_sqrt2",
            "noise",
            {"add_noise": _noise_scaled(1 / math.sqrt(2))},
        ),
        ("noise_repeated", "independence", {"add_noise": _noise_repeated}),
        ("canary_unclipped", "sensitivity", {"clip_factors": _unclipped}),
        ("example_counted_twice", "sensitivity", {"counted_twice": True}),
    )
    def test_a_fault_is_flagged_by_its_check(self, check, faults):
        """Each fault put into the mechanism fails its named check, and
        `check` raises `PrivacyAuditError` naming it."""
        patches = [
            mock.patch.object(accounting, name, fault)
            for name, fault in faults.items()
            if name != "counted_twice"
        ]
        accumulation = None
        if "counted_twice" in faults:
            accumulation = 2
            real = sampling.PoissonSampler._parts
            patches.append(
                mock.patch.object(
                    sampling.PoissonSampler, "_parts", _counted_twice(real)
                )
            )
        for patch in patches:
            patch.start()
        try:
            _, audit = _audited_fit(accumulation=accumulation)
        finally:
            for patch in patches:
                patch.stop()
        with self.assertRaisesRegex(auditing.PrivacyAuditError, check):
            audit.check(DELTA)
        found = audit.result(DELTA)
        self.assertFalse(found.checks[check], str(found))
        self.assertIn(check, found.failures)

    def test_the_sampler_goes_on_after_the_audited_run(self):
        """The wrapped sampler is the sampler: its epoch moved on with the
        audited fit, so training on it afterwards draws new batches."""
        sampler = _sampler()
        model = _model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        audit = auditing.CanaryAudit(num_canaries=10)
        model.fit(audit.wrap(sampler), epochs=2, callbacks=[audit], verbose=0)
        self.assertEqual(sampler.epoch, audit.sampler.epoch)
        self.assertGreaterEqual(sampler.epoch, 2)

    def test_a_refused_fit_leaves_the_audit_free(self):
        """A fit refused before training (a BatchNormalization that would
        learn from the data) leaves the audit unbound: the fixed model fits
        with the same audit and sampler."""
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        normalized = keras.layers.BatchNormalization()(inputs)
        refused = Private(
            inputs,
            keras.layers.Dense(2)(normalized),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=BATCH,
        )
        refused.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        audit = auditing.CanaryAudit(num_canaries=CANARIES, seed=7)
        wrapped = audit.wrap(_sampler())
        with self.assertRaisesRegex(ValueError, "BatchNormalization"):
            refused.fit(wrapped, callbacks=[audit], verbose=0)
        model = _model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(wrapped, epochs=2, callbacks=[audit], verbose=0)
        self.assertTrue(audit.check(DELTA).passed)

    def test_what_the_audit_refuses(self):
        """A model without a private step, an audit without its sampler (or
        the sampler without its audit), a run without noise, batches
        served outside a fit, a second sampler or model: each refused,
        naming the fix, before any step (the weights as they were)."""
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        plain = _model(Plain, global_clipnorm=1.0)
        plain.compile(optimizer="sgd", loss=loss)
        before = plain.get_weights()
        audit = auditing.CanaryAudit(num_canaries=10)
        with self.assertRaisesRegex(ValueError, "DifferentialPrivacyMixin"):
            plain.fit(audit.wrap(_sampler()), callbacks=[audit], verbose=0)
        for got, want in zip(plain.get_weights(), before):
            np.testing.assert_array_equal(got, want)
        private = _model()
        private.compile(optimizer="sgd", loss=loss)
        audit = auditing.CanaryAudit(num_canaries=10)
        wrapped = audit.wrap(_sampler())
        with self.assertRaisesRegex(ValueError, "audit.wrap"):
            private.fit(_sampler(), callbacks=[audit], verbose=0)
        with self.assertRaisesRegex(ValueError, "among fit's callbacks"):
            private.fit(wrapped, verbose=0)
        with self.assertRaisesRegex(ValueError, "outside such a fit"):
            wrapped[0]
        with self.assertRaisesRegex(ValueError, "one sampler"):
            audit.wrap(_sampler())
        with self.assertRaisesRegex(ValueError, "PoissonSampler"):
            auditing.CanaryAudit().wrap(wrapped)
        with self.assertRaisesRegex(ValueError, "no audited fit"):
            audit.result(DELTA)
        with self.assertRaisesRegex(ValueError, "delta=0"):
            audit.result(0)
        with self.assertRaisesRegex(ValueError, "validation data"):
            private.fit(
                wrapped,
                validation_data=wrapped,
                callbacks=[audit],
                verbose=0,
            )
        x, y = _data()
        weights = np.ones(SAMPLES, "float32")
        weights[3] = -1.0
        with self.assertRaisesRegex(ValueError, "negative sample weight"):
            auditing.CanaryAudit().wrap(
                sampling.PoissonSampler(x, y, BATCH, sample_weight=weights)
            )
        silent = _model(noise_multiplier=0.0)
        silent.compile(optimizer="sgd", loss=loss)
        with self.assertRaisesRegex(ValueError, "without noise"):
            silent.fit(wrapped, callbacks=[audit], verbose=0)
        private.fit(wrapped, callbacks=[audit], verbose=0)
        other = _model()
        other.compile(optimizer="sgd", loss=loss)
        with self.assertRaisesRegex(ValueError, "one model"):
            other.fit(wrapped, callbacks=[audit], verbose=0)
        for bad in ({"num_canaries": 1}, {"confidence": 1.5}, {"seed": -1}):
            with self.assertRaisesRegex(ValueError, next(iter(bad))):
                auditing.CanaryAudit(**bad)


@pytest.mark.tensorflow
class MirroredCanaryAuditTest(testing.TestCase):
    def test_two_replicas_record_each_update_once(self):
        """A model built and compiled under a MirroredStrategy over two
        CPUs, fitted outside its scope (Keras' pattern): the audit made in
        `fit` records each update once, and every check passes."""
        strategy = testing.mirrored_strategy()
        with strategy.scope():
            model = _model()
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
        audit = auditing.CanaryAudit(num_canaries=CANARIES, seed=7)
        model.fit(
            audit.wrap(_sampler()), epochs=2, callbacks=[audit], verbose=0
        )
        found = audit.check(DELTA)
        self.assertEqual(found.updates, 16)
        self.assertEqual(model.private_steps, 16)
