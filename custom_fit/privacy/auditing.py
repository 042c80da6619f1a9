"""Privacy auditing: an empirical lower bound on a run's epsilon.

An accountant's epsilon is an upper bound that holds if the implementation
does what the analysis assumes. An audit tests that assumption from the
outside: canaries (examples, or gradient-space vectors) are each included
in training with probability 1/2, an attacker scores every canary after
the run (higher: more likely included), and the scores bound epsilon from
below. A lower bound above the accountant's epsilon proves the run
leaked more than it claims: an implementation bug, never bad luck (at the
stated confidence). A lower bound below the claim proves nothing about
privacy; it only failed to find a bug.

`epsilon_lower_bound` is the one-run bound of Steinke, Nasr and Jagielski
2023 ("Privacy Auditing with One (1) Training Run", Theorem 3.1 with
delta): whichever threshold the attacker uses, guessing "included" for
the canaries that score at or above it, an (epsilon, delta)-DP run makes
many correct guesses only with small probability, so a count of correct
guesses that is too large for an epsilon rejects that epsilon. It works
on any scores, of any attack, from one run:

```python
rng = np.random.default_rng(0)
included = rng.random(1000) < 0.5
scores = rng.normal(size=1000) + 2.0 * included  # a leaky "run"
epsilon = custom_fit.auditing.epsilon_lower_bound(
    scores[included], scores[~included], delta=1e-5
)
```
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from custom_fit import _validation
from custom_fit import backend
from custom_fit.privacy import _canaries
from custom_fit.privacy import accounting
from custom_fit.privacy import sampling

__all__ = [
    "AuditResult",
    "CanaryAudit",
    "CanarySampler",
    "PrivacyAuditError",
    "epsilon_lower_bound",
]

# The bound is searched within [0, _MAX_EPSILON] to this tolerance.
_MAX_EPSILON = 100.0
_TOLERANCE = 1e-6


def epsilon_lower_bound(
    in_scores: Any,
    out_scores: Any,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """The largest epsilon that the canaries' scores refute, at a confidence.

    Each canary must have been included in the run independently with
    probability 1/2, before training (the scores of the included ones are
    `in_scores`, of the others `out_scores`), and a higher score must mean
    "more likely included". For every threshold `t`, the attacker guesses
    "included" for the `r` canaries scoring `>= t` and is right for `v` of
    them; an (epsilon, delta)-DP run gives `v` correct guesses or more with
    probability at most

        P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 * m * delta * alpha,

    where `m` is the number of canaries and `alpha` the largest
    `P[v - i <= Binomial(r, .) < v] / i` over `i = 1, ..., v` (Steinke,
    Nasr and Jagielski 2023, Theorem 3.1 with delta). The thresholds tried
    are fixed before looking at the scores: the `k`-th highest score for
    `k = m, m / 2^(1/4), m / 2^(2/4), ..., 1` (every canary scoring at
    least as high is guessed, so ties never split). An epsilon whose
    probability is at most `(1 - confidence) / T` at one of the `T`
    thresholds is refuted (a Bonferroni correction: the best threshold
    may be taken after looking). The result is the largest epsilon
    refuted, or 0.

    With probability at least `confidence` over the run's randomness (the
    canaries' inclusion, the noise), the returned value is at most the
    run's true epsilon at `delta`: above the accountant's figure, it shows
    the run leaks more than its accountant says. It is a lower bound: a
    small value shows nothing about the run's privacy.

    Args:
        in_scores: 1-D array-like of floats, the scores of the included
            canaries.
        out_scores: 1-D array-like of floats, the scores of the canaries
            left out.
        delta: Float in `[0, 1)`, the delta of the claim to test (the
            accountant's delta).
        confidence: Float in `[0.5, 1)`, the probability that the bound
            holds (0.95: a correct run's bound exceeds its true epsilon in
            at most 5% of runs).

    Returns:
        A float, the epsilon lower bound (0.0 when no epsilon is refuted).

    Raises:
        ValueError: For an empty or non-finite score array, or `delta` or
            `confidence` outside its range.

    Example:

    ```python
    >>> ins = np.linspace(2.0, 6.0, 500)    # included canaries score high
    >>> outs = np.linspace(-2.0, 2.0, 500)  # the others low
    >>> round(epsilon_lower_bound(ins, outs, delta=1e-5), 2)
    3.76
    ```
    """
    in_scores = _scores("in_scores", in_scores)
    out_scores = _scores("out_scores", out_scores)
    delta = _validation.non_negative_float("delta", delta)
    if delta >= 1.0:
        raise ValueError(
            "`delta` must be in [0, 1): a delta of 1 claims nothing. "
            f"Received: delta={delta!r}"
        )
    confidence = _confidence(confidence)
    guesses, correct = _guesses_per_threshold(in_scores, out_scores)
    canaries = in_scores.size + out_scores.size
    # Over every threshold of the grid, ties or not: the grid, not the
    # scores, sets the correction. Tied thresholds are tested once.
    significance = (1.0 - confidence) / guesses.size
    pairs = np.unique(np.stack([guesses, correct], axis=1), axis=0)
    guesses, correct = pairs[:, 0], pairs[:, 1]
    best = 0.0
    # Thresholds of higher precision first: a threshold whose share of
    # correct guesses is at most the accuracy e^eps / (1 + e^eps) of an
    # epsilon cannot refute that epsilon (the binomial's median is at
    # least that share), so most thresholds are skipped once one bound is
    # found.
    for index in np.argsort(-correct / guesses, kind="stable"):
        r, v = int(guesses[index]), int(correct[index])
        if v / r <= _accuracy(best):
            break
        if _p_value(best, canaries, r, v, 0.0) > significance:
            continue  # not refuted even with delta = 0: no larger bound
        best = _largest_refuted(best, canaries, r, v, delta, significance)
    return float(best)


def _scores(name: str, scores: Any) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"`{name}` must be a non-empty 1-D array of scores. Received: "
            f"an array of shape {array.shape}"
        )
    if not np.all(np.isfinite(array)):
        raise ValueError(
            f"`{name}` must hold finite scores. Received: "
            f"{int(np.sum(~np.isfinite(array)))} non-finite of {array.size}"
        )
    return array


def _confidence(confidence: Any) -> float:
    value = _validation.fraction("confidence", confidence)
    if not 0.5 <= value < 1.0:
        raise ValueError(
            "`confidence` must be in [0.5, 1): the probability that the "
            f"bound holds. Received: confidence={confidence!r}"
        )
    return value


def _guesses_per_threshold(
    in_scores: np.ndarray, out_scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Guesses and correct guesses at each threshold tried.

    At a threshold, the guesses are the canaries scoring at or above it,
    the correct ones the included among them. The thresholds are the
    `k`-th highest scores for `k` on a grid of quarter octaves fixed by the
    number of canaries alone.
    """
    scores = np.sort(np.concatenate([in_scores, out_scores]))[::-1]
    canaries = scores.size
    octaves = math.log2(canaries)
    ranks = np.unique(
        np.ceil(canaries * 2.0 ** -np.arange(0.0, octaves + 0.25, 0.25))
    ).astype(np.int64)
    thresholds = scores[np.clip(ranks, 1, canaries) - 1]
    correct = np.sum(in_scores[None, :] >= thresholds[:, None], axis=1)
    wrong = np.sum(out_scores[None, :] >= thresholds[:, None], axis=1)
    return correct + wrong, correct


def _accuracy(epsilon: float) -> float:
    """e^eps / (1 + e^eps): the accuracy of eps-DP randomized response."""
    return 1.0 / (1.0 + math.exp(-epsilon))


def _binomial_pmf(trials: int, epsilon: float) -> np.ndarray:
    """P[Binomial(trials, accuracy(epsilon)) = k] for k = 0..trials.

    Computed in logarithms: exact to float64 rounding for any size.
    """
    k = np.arange(trials + 1, dtype=np.float64)
    ratios = np.log(np.arange(trials, 0, -1.0)) - np.log(k[1:])
    log_choose = np.concatenate([[0.0], np.cumsum(ratios)])
    log_q = -math.log1p(math.exp(-epsilon))  # log(accuracy)
    log_not_q = -epsilon + log_q  # log(1 - accuracy)
    log_pmf = log_choose + k * log_q + (trials - k) * log_not_q
    pmf = np.exp(log_pmf - log_pmf.max())
    return pmf / pmf.sum()


def _p_value(
    epsilon: float, canaries: int, guesses: int, correct: int, delta: float
) -> float:
    """Theorem 3.1's p-value of `correct` of `guesses` right.

    The most probability an (epsilon, delta)-DP run gives to `correct` or
    more correct guesses out of `guesses`.
    """
    pmf = _binomial_pmf(guesses, epsilon)
    tail = float(pmf[correct:].sum())  # P[B >= correct]
    if delta == 0.0:
        return min(tail, 1.0)
    # P[correct - i <= B < correct] for i = 1..correct, each over i.
    below = np.cumsum(pmf[correct - 1 :: -1]) if correct else np.zeros(0)
    alpha = float(np.max(below / np.arange(1, correct + 1), initial=0.0))
    return min(tail + 2.0 * canaries * delta * alpha, 1.0)


def _largest_refuted(
    low: float,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    significance: float,
) -> float:
    """The largest epsilon whose p-value is at most `significance`.

    To `_TOLERANCE`; `low` when `low` itself is not refuted. The p-value
    grows with epsilon.
    """

    def refuted(epsilon: float) -> bool:
        p = _p_value(epsilon, canaries, guesses, correct, delta)
        return p <= significance

    if not refuted(low):
        return low
    high = max(1.0, 2.0 * low)
    while refuted(high):
        low, high = high, 2.0 * high
        if high > _MAX_EPSILON:
            return _MAX_EPSILON
    while high - low > _TOLERANCE:
        middle = 0.5 * (low + high)
        if refuted(middle):
            low = middle
        else:
            high = middle
    return low


# Checks pass within this many standard errors of what a correct step gives
# (a correct run fails one about once in 16,000 audits).
_CHECK_ERRORS = 4.0
# The slack of a check where the noise leaves no error (float32 sums).
_FLOAT_SLACK = 1e-3
# Key word of the generator of the canaries' membership.
_MEMBERS_KEY = 0x43414E41


class PrivacyAuditError(Exception):
    """A private run failed an audit check (`CanaryAudit.check`).

    Attributes:
        result: The `AuditResult` whose checks failed.
    """

    def __init__(self, message: str, result: "AuditResult") -> None:
        super().__init__(message)
        self.result = result


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What one audited run showed (`CanaryAudit.result`).

    Noise and contributions are in units of the clip bound
    (`l2_norm_clip`); each figure comes with its standard error.

    Attributes:
        epsilon_lower_bound: Float. The one-run lower bound on the run's
            epsilon at `delta` (`epsilon_lower_bound` of the canaries'
            scores), holding with probability `confidence`.
        epsilon_claimed: Float. The accountant's epsilon at `delta` for the
            audited updates (`custom_fit.privacy.epsilon`, Poisson
            sampling).
        delta: Float. The delta of both.
        confidence: Float. The confidence of the lower bound.
        noise_stddev: Float. The noise's measured standard deviation per
            coordinate, on the canaries' coordinates in updates they took
            no part in.
        noise_stddev_claimed: Float. The noise multiplier: the standard
            deviation a correct step adds.
        noise_ratio: Float. `noise_stddev / noise_stddev_claimed` (1 for a
            correct step).
        noise_ratio_error: Float. Its standard error.
        sensitivity: Float. A canary's measured contribution to an update
            it takes part in (1 for a correct step: a gradient of norm
            10 clipped to 1, once per update).
        sensitivity_error: Float. Its standard error.
        autocorrelation: Float. The correlation of the noise of
            consecutive updates on a coordinate (0 for a correct step).
        autocorrelation_error: Float. Its standard error.
        summed_noise_ratio: Float. The variance of a left-out canary's
            score (its noise summed over every update) over the updates
            times the noise's variance (1 when no update's noise repeats
            another's, at any distance).
        summed_noise_ratio_error: Float. Its standard error.
        participation_rate: Float. The share of updates an included canary
            took part in.
        sampling_rate: Float. The rate the sampler claims (that share, for
            a correct sampler).
        participation_rate_error: Float. The standard error of the
            measured share.
        out_canaries_seen: Integer. Updates in which a canary that was
            left out took part (0 for a correct sampler).
        updates: Integer. The audited updates.
        canaries_in: Integer. The canaries included in the data.
        canaries_out: Integer. The canaries left out.
        checks: Dict of check name (`"epsilon"`, `"noise"`,
            `"sensitivity"`, `"independence"`, `"sampling"`) to whether it
            passed.
        failures: Dict of the failed checks' names to what they found.
    """

    epsilon_lower_bound: float
    epsilon_claimed: float
    delta: float
    confidence: float
    noise_stddev: float
    noise_stddev_claimed: float
    noise_ratio: float
    noise_ratio_error: float
    sensitivity: float
    sensitivity_error: float
    autocorrelation: float
    autocorrelation_error: float
    summed_noise_ratio: float
    summed_noise_ratio_error: float
    participation_rate: float
    sampling_rate: float
    participation_rate_error: float
    out_canaries_seen: int
    updates: int
    canaries_in: int
    canaries_out: int
    checks: dict[str, bool]
    failures: dict[str, str]

    @property
    def passed(self) -> bool:
        """Whether every check passed."""
        return all(self.checks.values())

    def __str__(self) -> str:
        def verdict(name: str) -> str:
            return "passed" if self.checks[name] else "FAILED"

        return "\n".join(
            [
                f"Canary audit of {self.updates} updates, "
                f"{self.canaries_in} canaries in and {self.canaries_out} out:",
                f"  epsilon       lower bound {self.epsilon_lower_bound:.3f} "
                f"({self.confidence:.0%}) against the accountant's "
                f"{self.epsilon_claimed:.3f} at delta={self.delta:g}: "
                + verdict("epsilon"),
                f"  noise         {self.noise_ratio:.4f} +- "
                f"{self.noise_ratio_error:.4f} of the claimed standard "
                "deviation: " + verdict("noise"),
                f"  sensitivity   {self.sensitivity:.3f} +- "
                f"{self.sensitivity_error:.3f} clip bounds per "
                "participation: " + verdict("sensitivity"),
                f"  independence  autocorrelation {self.autocorrelation:+.4f}"
                f" +- {self.autocorrelation_error:.4f}, summed noise "
                f"{self.summed_noise_ratio:.3f} +- "
                f"{self.summed_noise_ratio_error:.3f} of independent: "
                + verdict("independence"),
                f"  sampling      participation {self.participation_rate:.4f}"
                f" +- {self.participation_rate_error:.4f} against the rate "
                f"{self.sampling_rate:.4f}, {self.out_canaries_seen} "
                "left-out canaries seen: " + verdict("sampling"),
            ]
        )


class _Wrapping:
    """What a `CanarySampler` keeps beside its sampler's state."""

    def __init__(self, audit: Any) -> None:
        self.audit = audit
        # The model whose audited `fit` the sampler serves, or `None`.
        self.feeding: Any = None


class CanarySampler(sampling.PoissonSampler):
    """A `PoissonSampler` whose draws carry an audit's canaries.

    Made by `CanaryAudit.wrap`, on the sampler's own state (its seed, its
    epoch: training on the sampler afterwards goes on from where the
    audited run ended, never repeating its draws). Each canary is included
    in the run's data with probability 1/2 (from the sampler's secret
    seed, or the audit's `seed`); each draw is then made, by the sampler's
    own code, from the examples and the included canaries together, every
    one with the sampler's rate, and the canaries are dealt to batches
    (gradient accumulation) and to processes exactly as examples are. A
    canary's row holds zeros, with sample weight `-(j + 1)` for canary
    `j`: only the private training step of the model whose `fit` runs the
    audit reads it, so the sampler serves batches only to that `fit`.
    """

    def __init__(self, sampler: sampling.PoissonSampler, audit: Any) -> None:
        # Not `PoissonSampler.__init__`: the sampler's own state, shared.
        self.__dict__ = sampler.__dict__
        self._wrapping = _Wrapping(audit)

    @property
    def audit(self) -> Any:
        """The `CanaryAudit` whose canaries the draws carry."""
        return self._wrapping.audit

    @property
    def num_canaries(self) -> int:
        """The audit's number of canaries."""
        return int(self._wrapping.audit.num_canaries)

    def included(self) -> np.ndarray:
        """Returns which canaries are in the data: a boolean vector.

        Each with probability 1/2, from the audit's `seed` or else the
        sampler's own (secret) seed: the same in every process once `fit`
        has handed process 0's seed to the others.
        """
        seed = self.audit.seed
        key = [self._entropy if seed is None else seed, _MEMBERS_KEY]
        generator = np.random.default_rng(key)
        return generator.random(self.num_canaries) < 0.5

    def draw(self, epoch: int, number: int) -> np.ndarray:
        """Returns the examples of one draw, then its canaries.

        One Poisson draw over the examples and the included canaries
        together (the sampler's own draw, over a population that holds the
        canaries too). Canary `j` is listed as `num_examples + j`.

        Args:
            epoch: Integer >= 0, as in `PoissonSampler.draw`.
            number: Integer >= 0, as in `PoissonSampler.draw`.

        Returns:
            A NumPy array of indices, the examples' in order, then the
            canaries'.
        """
        members = np.flatnonzero(self.included())
        chosen = self._drawn(epoch, number, self.num_examples + members.size)
        canaries = chosen >= self.num_examples
        chosen[canaries] = (
            self.num_examples + members[chosen[canaries] - self.num_examples]
        )
        return chosen

    def __getitem__(self, index: int) -> tuple[Any, Any, np.ndarray]:
        if self._wrapping.feeding is None:
            raise ValueError(
                "The batches of an audited sampler carry canary rows (sample "
                "weight below 0) that only the private step of the audited "
                "model reads. Received: a request for batch "
                f"{index} outside such a fit. Pass the sampler to `fit` of a "
                "DifferentialPrivacyMixin model with its CanaryAudit among "
                "the callbacks: model.fit(audit.wrap(sampler), "
                "callbacks=[audit])."
            )
        return super().__getitem__(index)

    def _rows(
        self, chosen: np.ndarray, padding: int
    ) -> tuple[Any, Any, np.ndarray]:
        examples = chosen[chosen < self.num_examples]
        canaries = chosen[chosen >= self.num_examples] - self.num_examples
        x, y, weights = super()._rows(examples, padding + canaries.size)
        rows = slice(examples.size, examples.size + canaries.size)
        weights[rows] = -(canaries.astype(weights.dtype) + 1)
        return x, y, weights


class CanaryAudit(keras.callbacks.Callback):
    """Audits a private run with canaries in gradient space, in one run.

    DP-SGD bugs (noise too small or missing, a gradient left unclipped,
    noise that repeats, an example counted twice in an update, batches not
    drawn as the accountant assumes) leave training working and the claimed
    epsilon wrong. This audit measures the mechanism on the user's own run:
    `num_canaries` canaries, each included in the data with probability
    1/2, are drawn with the examples by the sampler's own draw and dealt to
    batches and processes as examples are (`wrap` the `PoissonSampler`);
    each canary row's gradient is a vector of norm 10 times the clip bound
    on a coordinate of its own (an audit slot that the loss never reads),
    which the step clips with the examples' clip function, sums (over an
    update's batches, replicas and processes) and noises in the same call
    as the model's gradients. Inside the step (compiled,
    `steps_per_execution > 1`, several processes) the slot's noisy sum of
    each update is recorded, with no host read.

    After `fit`, `result(delta)` gives:

    - the one-run lower bound on epsilon (`epsilon_lower_bound` of the
      canaries' summed slot values; Steinke, Nasr and Jagielski 2023)
      against the accountant's epsilon for the audited updates (the
      accountant `calibrate_noise` used, else Renyi DP's);
    - the noise's standard deviation on the canaries' coordinates against
      the noise multiplier;
    - the sensitivity: a canary's contribution to an update it takes part
      in (the clip bound, once, for a correct step);
    - the noise's independence: its correlation between consecutive
      updates (0), and the variance of a left-out canary's noise summed
      over every update (the updates times one update's, unless some
      update's noise repeats another's at any distance);
    - the share of updates an included canary took part in against the
      sampler's rate, and whether a left-out canary ever took part.

    `check(delta)` raises `PrivacyAuditError` naming each check that failed.
    A measured check fails beyond 4 standard errors of what a correct step
    gives (for a correct run, each about once in 16,000 audits, any of the
    four about once in 4,000; the errors are normal approximations, which
    need tens of participations), and the epsilon check fails when the
    lower bound exceeds the claim. Passing proves no privacy: it finds
    bugs, in what the canaries pass through. They do not pass through
    everything: the noise is measured on the slot (the last tensor of the
    noise call), so noise dropped on a model variable alone is not seen;
    a canary's norm is set by the audit, so a wrong norm of an example's
    own gradient (a ghost-clipping error) is not seen
    (`logs["dp_clipped_fraction"]` shows that one).

    The audited run is the model's private step with one example per
    microbatch on Poisson batches (`expected_batch_size`); the canaries
    cost a few rows per batch (`sampling_rate * num_canaries / 2` on
    average) and `9 * num_canaries` floats of state. They reach the model's
    loss with weight 0, so the weights train as without the audit (on the
    examples the draw gives), but they count in the logged loss and in
    metrics without sample weights as the sampler's padding rows do: use
    `weighted_metrics`, and mind callbacks that watch the loss. The
    wrapped sampler shares the sampler's state: training on the sampler
    afterwards goes on from the audited run's epoch. A model without a
    private step, or without noise, is refused, and so is the audited
    sampler as validation data.

    Args:
        num_canaries: Integer >= 2. The canaries (half included on
            average). Defaults to 1000.
        seed: Integer >= 0 or `None`. Seed of which canaries are included,
            for a reproducible audit; `None` (the default) takes them from
            the sampler's secret seed. Their draws always follow the
            sampler's seed.
        confidence: Float in `[0.5, 1)`. The confidence of the epsilon
            lower bound. Defaults to 0.95.

    Example:

    ```python
    sampler = custom_fit.sampling.PoissonSampler(x, y, batch_size=64)
    model = Net(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.1,
                expected_batch_size=sampler.batch_size)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    audit = custom_fit.auditing.CanaryAudit()
    model.fit(audit.wrap(sampler), epochs=3, callbacks=[audit])
    print(audit.check(delta=1e-5))  # raises PrivacyAuditError on a bug
    ```
    """

    def __init__(
        self,
        num_canaries: int = 1000,
        seed: int | None = None,
        confidence: float = 0.95,
    ) -> None:
        super().__init__()
        self.num_canaries = _validation.positive_int(
            "num_canaries", num_canaries
        )
        if self.num_canaries < 2:
            raise ValueError(
                "`num_canaries` must be at least 2: the audit compares "
                "included canaries with left-out ones. Received: "
                f"num_canaries={num_canaries}. Pass for example 1000."
            )
        self.seed = _validation.seed_or_none("seed", seed)
        self.confidence = _confidence(confidence)
        self.sampler: CanarySampler | None = None
        self._audited: Any = None
        self._slot: Any = None
        # Whether a fit of `_audited` began training (then it stays bound).
        self._bound = False

    def wrap(self, sampler: sampling.PoissonSampler) -> CanarySampler:
        """Returns `sampler`'s draws with this audit's canaries added.

        Train on what it returns. It shares `sampler`'s state (its seed and
        epoch): training on `sampler` afterwards goes on from the audited
        run's epoch.

        Args:
            sampler: A `custom_fit.sampling.PoissonSampler`.

        Returns:
            A `CanarySampler`.

        Raises:
            ValueError: For anything else, or a second sampler.
        """
        if not isinstance(sampler, sampling.PoissonSampler) or isinstance(
            sampler, CanarySampler
        ):
            raise ValueError(
                "`CanaryAudit.wrap` takes a custom_fit.sampling."
                "PoissonSampler: the canaries are drawn as its examples are. "
                f"Received: sampler={type(sampler).__name__}. Pass "
                "PoissonSampler(x, y, batch_size=...)."
            )
        if self.sampler is not None or "_wrapping" in vars(sampler):
            raise ValueError(
                "A CanaryAudit wraps one sampler, and a sampler takes one "
                "audit's canaries: their membership and statistics belong to "
                "one run. Received: a second sampler for this audit, or a "
                "sampler another audit wrapped. Make a new CanaryAudit and "
                "a new PoissonSampler."
            )
        weights = np.asarray(sampler._weights)
        if np.any(weights < 0):
            raise ValueError(
                "An audited sampler marks its canaries with sample weights "
                "below 0, so the examples' weights must be >= 0. Received: "
                f"{int(np.sum(weights < 0))} negative sample weight(s), the "
                f"smallest {float(weights.min())}. Pass weights >= 0."
            )
        self.sampler = CanarySampler(sampler, self)
        return self.sampler

    def on_train_begin(self, logs: Any = None) -> None:
        """Refuses a model whose `fit` did not take the audit's canaries."""
        if self._audited is None or self._audited is not self.model:
            raise ValueError(
                "CanaryAudit audits the private step of a "
                "DifferentialPrivacyMixin model, and this model has none "
                "that takes canaries. Received: a model of class "
                f"{type(self.model).__name__}. Train a model built with "
                "custom_fit.DifferentialPrivacyMixin."
            )
        self._bound = True

    def result(self, delta: float) -> AuditResult:
        """Returns what the audited updates show.

        Args:
            delta: Float in `(0, 1)`: the delta of the claim to test.

        Returns:
            An `AuditResult`.

        Raises:
            ValueError: For a `delta` outside `(0, 1)`, or before any
                audited update.
        """
        delta = _validation.fraction("delta", delta)
        if not 0.0 < delta < 1.0:
            raise ValueError(
                "`delta` must be in (0, 1): the delta of the accountant's "
                f"claim. Received: delta={delta!r}. Pass for example 1e-5."
            )
        model, sampler = self._audited, self.sampler
        if model is None or sampler is None or not self._bound:
            raise ValueError(
                "`CanaryAudit.result` reads the audited run: call it after "
                "`fit` trained on `audit.wrap(sampler)` with the audit among "
                "the callbacks. Received: no audited fit."
            )
        values = backend.current().host_value(model, self._slot.statistics)
        rows = {
            name: np.asarray(row, np.float64)
            for name, row in zip(_canaries.ROWS, values)
        }
        clip = float(model.l2_norm_clip)
        sigma = float(model.noise_multiplier)
        updates = int(round(rows["participations"][0] + rows["noise_count"][0]))
        if updates == 0:
            raise ValueError(
                "`CanaryAudit.result` found no audited update. Received: an "
                "audit whose fit made no step. Train first."
            )
        included = sampler.included()
        scores = rows["score"] / clip
        bound = epsilon_lower_bound(
            scores[included], scores[~included], delta, self.confidence
        )
        # The accountant the noise was calibrated with (`calibrate_noise`),
        # else Renyi DP's (looser: a weaker check).
        claimed = accounting.epsilon(
            steps=updates,
            batch_size=round(sampler.sampling_rate * sampler.num_examples),
            num_examples=sampler.num_examples,
            noise_multiplier=sigma,
            delta=delta,
            accountant=getattr(model.noise_multiplier, "accountant", "rdp"),
        )
        return _judged(
            rows,
            included,
            clip,
            sigma,
            sampler.sampling_rate,
            updates,
            bound,
            claimed,
            delta,
            self.confidence,
        )

    def check(self, delta: float) -> AuditResult:
        """Returns `result(delta)`, or raises if a check failed.

        Args:
            delta: Float in `(0, 1)`.

        Returns:
            The `AuditResult`, every check passed.

        Raises:
            PrivacyAuditError: Naming each failed check and what it found.
        """
        found = self.result(delta)
        if not found.passed:
            named = "; ".join(
                f"{name}: {why}" for name, why in found.failures.items()
            )
            raise PrivacyAuditError(
                f"The private run failed the audit's "
                f"{', '.join(found.failures)} check(s). {named}.",
                found,
            )
        return found

    def _attach(self, model: Any) -> Any:
        """Returns the audit's state in `model`'s step, made once."""
        if self._audited is not None and self._audited is not model:
            raise ValueError(
                "A CanaryAudit audits one model's run. Received: a second "
                f"model, {model.name!r}. Make a new CanaryAudit for it."
            )
        if self._slot is None:
            self._slot = _canaries.Slot(model, self, self.num_canaries)
        self._audited = model
        return self._slot


def _judged(
    rows: dict[str, np.ndarray],
    included: np.ndarray,
    clip: float,
    sigma: float,
    rate: float,
    updates: int,
    bound: float,
    claimed: float,
    delta: float,
    confidence: float,
) -> AuditResult:
    """The figures of an audit's statistics, and its checks."""
    failures: dict[str, str] = {}
    clean = float(rows["noise_count"].sum())
    variance = float(rows["noise_squares"].sum()) / max(clean, 1.0)
    stddev = math.sqrt(variance) / clip
    ratio = stddev / sigma
    ratio_error = ratio / math.sqrt(2.0 * max(clean, 1.0))
    if abs(ratio - 1.0) > _CHECK_ERRORS * ratio_error or clean < 2:
        failures["noise"] = (
            f"the noise's standard deviation is {ratio:.4f} +- "
            f"{ratio_error:.4f} of noise_multiplier * l2_norm_clip, not 1"
        )
    taken = float(rows["participations"][included].sum())
    sensitivity = float(rows["in_sum"][included].sum()) / clip / max(taken, 1)
    sensitivity_error = stddev / math.sqrt(max(taken, 1.0))
    if taken == 0 or abs(sensitivity - 1.0) > max(
        _CHECK_ERRORS * sensitivity_error, _FLOAT_SLACK
    ):
        failures["sensitivity"] = (
            "no included canary took part in an update"
            if taken == 0
            else f"a canary moved an update by {sensitivity:.3f} +- "
            f"{sensitivity_error:.3f} clip bounds, not 1 (unclipped, or "
            "counted more than once)"
        )
    pairs = float(rows["lag_pairs"].sum())
    correlation = float(rows["lag_products"].sum()) / max(
        pairs * variance, 1e-30
    )
    correlation_error = 1.0 / math.sqrt(max(pairs, 1.0))
    # A left-out canary's score sums pure noise over every update: its
    # variance is `updates` times the noise's, unless the noise of some
    # updates repeats (at any distance: an epoch, a fit).
    outs = rows["score"][~included]
    spread = float(np.mean(outs * outs)) / max(updates * variance, 1e-30)
    spread_error = math.sqrt(2.0 / max(outs.size, 1))
    if variance == 0.0:
        failures["independence"] = "no noise measured: none to test"
    elif pairs < 2:
        failures["independence"] = "fewer than 2 pairs of consecutive updates"
    elif abs(correlation) > _CHECK_ERRORS * correlation_error:
        failures["independence"] = (
            f"consecutive updates' noise correlates ({correlation:+.4f} +- "
            f"{correlation_error:.4f}): it repeats"
        )
    elif abs(spread - 1.0) > _CHECK_ERRORS * spread_error:
        failures["independence"] = (
            "the noise summed over the updates varies "
            f"{spread:.3f} +- {spread_error:.3f} times as much as "
            "independent noise would: some updates' noise repeats"
        )
    members = int(included.sum())
    share = taken / max(members * updates, 1)
    share_error = math.sqrt(rate * (1.0 - rate) / max(members * updates, 1))
    seen = int(rows["participations"][~included].sum())
    if seen or abs(share - rate) > _CHECK_ERRORS * max(share_error, 1e-12):
        failures["sampling"] = (
            f"left-out canaries took part in {seen} update(s)"
            if seen
            else f"included canaries took part in {share:.4f} +- "
            f"{share_error:.4f} of the updates, at a rate of {rate:.4f}"
        )
    if bound > claimed:
        failures["epsilon"] = (
            f"the run's epsilon is at least {bound:.3f} "
            f"({confidence:.0%} confidence), above the accountant's "
            f"{claimed:.3f}"
        )
    names = ("epsilon", "noise", "sensitivity", "independence", "sampling")
    return AuditResult(
        epsilon_lower_bound=bound,
        epsilon_claimed=claimed,
        delta=delta,
        confidence=confidence,
        noise_stddev=stddev,
        noise_stddev_claimed=sigma,
        noise_ratio=ratio,
        noise_ratio_error=ratio_error,
        sensitivity=sensitivity,
        sensitivity_error=sensitivity_error,
        autocorrelation=correlation,
        autocorrelation_error=correlation_error,
        summed_noise_ratio=spread,
        summed_noise_ratio_error=spread_error,
        participation_rate=share,
        sampling_rate=rate,
        participation_rate_error=share_error,
        out_canaries_seen=seen,
        updates=updates,
        canaries_in=members,
        canaries_out=int(included.size - members),
        checks={name: name not in failures for name in names},
        failures=failures,
    )


def audit_of_fit(model: Any, arguments: dict[str, Any]) -> Any:
    """Returns the `CanaryAudit` of a private model's `fit`, or `None`.

    Checks that the audit and its sampler come together, and that the
    model's step is one the audit measures.

    Raises:
        ValueError: Naming what is missing or refused.
    """
    callbacks = arguments.get("callbacks") or ()
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    audits = [c for c in callbacks if isinstance(c, CanaryAudit)]
    x = arguments.get("x")
    validation = arguments.get("validation_data")
    if isinstance(validation, CanarySampler) or any(
        isinstance(part, CanarySampler)
        for part in (validation if isinstance(validation, tuple) else ())
    ):
        raise ValueError(
            "An audited sampler's batches carry canary rows that only the "
            "private training step reads: they cannot be validation data. "
            "Received: validation_data=<the audited sampler>. Validate on "
            "arrays, or on a PoissonSampler that is not wrapped."
        )
    if isinstance(x, CanarySampler) and x.audit not in audits:
        raise ValueError(
            "An audited sampler's canaries are read by its CanaryAudit, "
            "which must be among fit's callbacks. Received: "
            f"callbacks={[type(c).__name__ for c in callbacks]}. Pass "
            "callbacks=[audit] with the audit whose `wrap` made the sampler."
        )
    if not audits:
        return None
    if len(audits) > 1:
        raise ValueError(
            "One CanaryAudit per fit: the canaries of one audit travel in "
            f"the data. Received: {len(audits)} CanaryAudit callbacks. Pass "
            "one."
        )
    audit = audits[0]
    if not isinstance(x, CanarySampler) or x.audit is not audit:
        raise ValueError(
            "A CanaryAudit's canaries travel in the data, drawn as the "
            "examples are: fit must train on the sampler the audit wrapped. "
            f"Received: x={type(x).__name__}. Pass "
            "x=audit.wrap(PoissonSampler(x, y, batch_size=...))."
        )
    if not model.noise_multiplier:
        raise ValueError(
            "CanaryAudit cannot audit a run without noise: it claims no "
            "privacy, and there is nothing to measure. Received: "
            f"noise_multiplier={model.noise_multiplier!r}. Train with noise."
        )
    if model.num_microbatches is not None:
        raise ValueError(
            "CanaryAudit needs one example per microbatch: each canary is "
            "a microbatch of its own. Received: num_microbatches="
            f"{model.num_microbatches!r}. Leave num_microbatches out."
        )
    return audit


@contextlib.contextmanager
def feeding(audit: Any, model: Any) -> Iterator[Any]:
    """While open, the audit's sampler serves `model`'s fit.

    Yields:
        The audit's state in `model`'s step (`_canaries.Slot`), or `None`
        without an audit.
    """
    if audit is None:
        yield None
        return
    slot = audit._attach(model)
    # An update window an earlier fit left open is dropped with the model's.
    slot.pending.assign(np.zeros(slot.pending.shape, "float32"))
    wrapping = audit.sampler._wrapping
    wrapping.feeding = model
    try:
        yield slot
    finally:
        wrapping.feeding = None
        if not audit._bound:
            # Refused before training began: the audit stays free.
            audit._audited = audit._slot = None
