"""An --environment whose class scores each model turn (get_turn_rewards), for
tests/test_turn_credit.py's run of gspo_token.py --turn-credit: the rewards differ from turn to
turn, so D_it (turn_advantages) moves credit between an episode's turns."""


class Turns:
    """A running total the model adds to."""

    def reset(self, **row):
        self.total = 0

    def add(self, n: int) -> int:
        """Add n to the total.

        Args:
            n: the amount
        """
        self.total += n
        return self.total

    def get_turn_rewards(self, turns: list[str]) -> list[float]:
        """Turn k scores 0.5 k - 0.3, whatever it says."""
        return [0.5 * k - 0.3 for k in range(len(turns))]
