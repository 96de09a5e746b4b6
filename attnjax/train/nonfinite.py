"""The host side of the non-finite guard (``attnjax.train.optim.guard_nonfinite``).

Each train step returns a ``nonfinite`` metric (1.0 when its loss or gradient norm was NaN or
inf and its update was dropped). The loop hands the flags to ``NonfiniteWatch.check`` when it
fetches metrics anyway (every ``log_every`` steps) and before every checkpoint save, so the
guard adds no device-to-host sync per step and no checkpoint is written past a stop.

``config.nonfinite``: ``"stop"`` (default) raises ``NonFiniteError`` at the first flagged
step; ``"skip"`` counts dropped steps and raises once ``config.max_skipped_steps`` (default
10) follow each other.
"""

from __future__ import annotations

from typing import Sequence

from absl import logging

MODES = ("stop", "skip")


class NonFiniteError(FloatingPointError):
    """Training produced a non-finite loss or gradient; nothing after it was saved."""


def check_config(config) -> None:
    mode = config.get("nonfinite", "stop")
    if mode not in MODES:
        raise ValueError(f"config.nonfinite={mode!r}; expected one of {MODES}.")
    limit = config.get("max_skipped_steps", 10)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"config.max_skipped_steps={limit!r} must be a positive integer.")


class NonfiniteWatch:
    """Reads the per-step ``nonfinite`` flags in step order; each step is counted once."""

    def __init__(self, config, start_step: int):
        self.mode = config.get("nonfinite", "stop")
        self.limit = config.get("max_skipped_steps", 10)
        self.checked_through = start_step
        self.skipped = 0
        self.in_a_row = 0

    def check(self, last_step: int, flags: Sequence[float]) -> None:
        """``flags``: those of steps ``last_step - len(flags) + 1 .. last_step``."""
        first = last_step - len(flags) + 1
        for step, flag in enumerate(flags, start=first):
            if step <= self.checked_through:
                continue
            self.checked_through = step
            if not float(flag):
                self.in_a_row = 0
                continue
            if self.mode == "stop":
                raise NonFiniteError(
                    f"the loss or gradient norm became non-finite at step {step} "
                    f"(config.nonfinite='stop'); nothing from step {step} on was saved and the "
                    f"earlier checkpoints are kept; lower config.learning_rate, or set "
                    f"config.nonfinite='skip' to drop such steps."
                )
            self.skipped += 1
            self.in_a_row += 1
            logging.warning("step %d: non-finite loss or gradient norm, update dropped", step)
            if self.in_a_row >= self.limit:
                raise NonFiniteError(
                    f"{self.in_a_row} steps in a row up to step {step} had a non-finite loss or "
                    f"gradient norm (config.max_skipped_steps={self.limit}); lower "
                    f"config.learning_rate."
                )
