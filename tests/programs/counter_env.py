"""An --environment for grouprl/episodes.py (TRL 1.16's environment_factory contract), the example
the README and docs name: `python gspo.py --environment tests/programs/counter_env.py:Counter`.
One instance per episode, in the tool worker; its public methods but reset and the scores are the
model's tools (their schemas from type hints and docstrings, as transformers' get_json_schema
makes them). The episode scores 1 when the counter ends at the prompt's answer."""


class Counter:
    """A counter the model adds to."""

    def reset(self, answer: str, **row) -> str:
        """Before the episode (TRL: reset(**row)): the row's columns; the string returned is
        appended to the prompt's last message."""
        self.target, self.count = str(answer).strip(), 0
        return " A counter starts at 0."

    def add(self, n: int) -> int:
        """Add n to the counter.

        Args:
            n: the amount
        """
        self.count += n
        return self.count

    def get_reward(self) -> float:
        """The episode's reward (TRL: one more reward source, weight 1, logged as rewards/Counter/)."""
        return float(str(self.count) == self.target)

    def get_turn_rewards(self, turns: list[str]) -> list[float]:
        """One reward per model turn (ours, for gspo_token.py): 1 for a turn that says the count."""
        return [float(str(self.count) in turn) for turn in turns]
