"""A resumable, seeded, epoch-based sampler of dataset indices.

Epoch e visits every index once, in the order of a permutation seeded by (seed, e) (or in order
without shuffle). The whole state is (epoch, position in the epoch), so a sampler restored from
``state_dict()`` continues with exactly the indices an uninterrupted one would give, on any number
of ranks (every rank samples the same global indices).
"""

from __future__ import annotations

import numpy as np

__all__ = ["PromptSampler"]


class PromptSampler:
    """Draws dataset indices batch by batch; a batch may run across an epoch boundary."""

    def __init__(self, num_items: int, seed: int, shuffle: bool):
        if num_items < 1:
            raise ValueError(f"num_items={num_items}: the sampler needs a non-empty dataset")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0 (train.seed)")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Epochs completed."""
        self.position = 0
        """Indices already taken from the current epoch's order."""
        self._order: list[int] | None = None  # the current epoch's order, built on first use
        self._order_epoch = -1

    @property
    def consumed(self) -> int:
        """Indices drawn since the start (all epochs)."""
        return self.epoch * self.num_items + self.position

    def _current_order(self) -> list[int]:
        if self._order is None or self._order_epoch != self.epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch]))
                self._order = rng.permutation(self.num_items).tolist()
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = self.epoch
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """The next `n` indices (n may exceed the dataset: the sampler wraps into later epochs)."""
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        out: list[int] = []
        while len(out) < n:
            order = self._current_order()
            take = min(n - len(out), self.num_items - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
        return out

    def rewind(self, n: int) -> None:
        """Give back the last ``n`` indices drawn: the next ``next_indices(n)`` returns them again."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"rewind({n}): {self.consumed} indices were drawn")
        self.epoch, self.position = divmod(self.consumed - n, self.num_items)

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue: position, and the settings it is only valid with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`. Refuses a state taken with another dataset size, seed or shuffle
        setting: the indices would not continue the checkpointed run's order."""
        missing = sorted({"epoch", "position", "num_items", "seed", "shuffle"} - set(state))
        if missing:
            raise ValueError(f"sampler state lacks {missing}: it was not written by PromptSampler.state_dict")
        mismatches = [
            f"{key}: checkpoint {int(state[key])} vs now {now} ({fix})"
            for key, now, fix in (
                ("num_items", self.num_items, "the training set changed: use the same data.* settings"),
                ("seed", self.seed, "set train.seed to the checkpoint's"),
                ("shuffle", int(self.shuffle), "set data.shuffle to the checkpoint's"),
            )
            if int(state[key]) != now
        ]
        if mismatches:
            raise ValueError("cannot resume the prompt sampler: " + "; ".join(mismatches))
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_items:
            raise ValueError(f"sampler state epoch={epoch} position={position} is out of range")
        self.epoch, self.position = epoch, position
