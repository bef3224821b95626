"""Exponential back-off: the one way a loop in nodeagent waits longer after each failure.

``Backoff(initial, maximum)`` hands out ``initial``, then twice that, and so on up to ``maximum``;
``reset()`` starts over after a success. With ``jitter`` (the default) each delay is "equal jitter":
half the step fixed, half random, so many clients that failed together do not all come back together.
Without it the delays are the plain doubling sequence (for a single local peer, and for tests that
count them). The helper only computes delays; the caller sleeps the way its context allows
(``asyncio.sleep``, ``threading.Event.wait``).
"""

from __future__ import annotations

import random

# 2**32 steps is far beyond any cap; the bound only keeps the exponent from growing without end.
_MAX_ATTEMPT = 32


class Backoff:
    """Delays that double from ``initial`` up to ``maximum``, with equal jitter unless ``jitter=False``."""

    def __init__(
        self,
        initial: float = 0.5,
        maximum: float = 30.0,
        rng: random.Random | None = None,
        *,
        jitter: bool = True,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self.rng = rng or random.Random()
        self.attempt = 0

    def next(self) -> float:
        """The delay before the next attempt (and count this one)."""
        step = min(self.maximum, self.initial * (2**self.attempt))
        self.attempt = min(self.attempt + 1, _MAX_ATTEMPT)
        if not self.jitter:
            return float(step)
        return float(step / 2 + self.rng.uniform(0, step / 2))

    def reset(self) -> None:
        """Start over at ``initial`` (after a success)."""
        self.attempt = 0
