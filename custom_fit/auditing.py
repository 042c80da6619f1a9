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

import math
from typing import Any

import numpy as np

from custom_fit import _validation

__all__ = ["epsilon_lower_bound"]

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
