"""The --environment classes tests/test_episodes.py runs (the checks' bad classes, the worker's
instances, resets that differ, a broken reset and turn count), each named by FILE.py:Class.
N: Count's resets so far, in the one worker process that imports this file."""

import asyncio
import os

# ---- the checks' bad classes (test_environment_checks_are_one_line)
class NoReset:
    def look(self, key: str) -> str:
        """Look.

        Args:
            key: a key
        """


class NoTools:
    def reset(self, **row):
        pass

    def get_reward(self) -> float:
        return 1.0

    def _hidden(self, x: int) -> int:
        return x


class NoSchema:
    def reset(self, **row):
        pass

    def look(self, key):
        return key


class Multiply:
    def reset(self, **row):
        pass

    def multiply(self, a: int) -> int:
        """Clash.

        Args:
            a: a
        """


# ---- one instance an episode, in the worker (test_environment_instances_live_in_the_worker_one_per_episode)
class Where:
    def reset(self, key: str, **row):
        self.key, self.seen = key, []
        return None

    def note(self, x: int) -> str:
        """Note x.

        Args:
            x: a number
        """
        self.seen.append(x)
        return f"{self.key}:{self.seen}:{os.getpid()}"

    def crash(self) -> str:
        """End the process."""
        os._exit(3)

    def get_reward(self) -> float:
        return float(sum(self.seen))


# ---- resets that differ (test_resets_that_differ_give_one_prompt_a_row)
N = [0]


class Count:
    def reset(self, **row):
        N[0] += 1
        return f" #{N[0]}"

    def noop(self) -> str:
        """Nothing."""
        return ""


# ---- a broken reset and turn count (test_a_broken_reset_or_turn_count_stops_in_one_line)
class Broken:
    def reset(self, answer: str, **row):
        if answer == "bad":
            raise KeyError("no such answer")

    def noop(self) -> str:
        """Nothing."""
        return ""

    def get_turn_rewards(self) -> list:
        return [1.0, 2.0]


# ---- an async --tools function (test_async_calls_run_after_the_rounds_others_and_survive_a_restart)
async def shout(text: str) -> str:
    """Text in capitals, as a coroutine.

    Args:
        text: the text
    """
    return text.upper()


# ---- TRL parity (tests/test_episodes_trl.py): TRL's GRPOTrainer runs this class too
class Ledger:
    """reset's string from the row's 'obs' column (None where it is empty; 'keys': the row's other
    keys, as reset is given them), a total carried between one episode's calls, a call that
    changes the state and raises, a result past any budget, a static method, an async method; an
    async get_reward from the state (None where no call was made: NaN, does not apply)."""

    def reset(self, obs: str = "", **row):
        self.total, self.calls = 0, 0
        if obs == "keys":
            return " (row: " + ",".join(sorted(row)) + ")"
        return obs or None

    def add(self, n: int) -> str:
        """Add n to the total.

        Args:
            n: the number to add
        """
        self.total, self.calls = self.total + n, self.calls + 1
        return f"total {self.total}"

    def fail(self, why: str) -> str:
        """Count the call, then raise.

        Args:
            why: the error's message
        """
        self.calls += 1
        raise RuntimeError(why)

    def pad(self, n: int) -> str:
        """n characters.

        Args:
            n: how many
        """
        self.calls += 1
        return "x" * n

    @staticmethod
    def double(n: int) -> int:
        """Twice n (no state).

        Args:
            n: the number
        """
        return 2 * n

    async def later(self, n: int) -> str:
        """Add n to the total, as a coroutine (TRL awaits it after the turn's other calls).

        Args:
            n: the number to add (negative: it raises)
        """
        await asyncio.sleep(0)
        if n < 0:
            raise ValueError(f"{n} < 0")
        self.total, self.calls = self.total + n, self.calls + 1
        return f"total {self.total}"

    async def get_reward(self) -> float | None:  # async: TRL awaits it, as any async reward
        return None if not self.calls else self.total + self.calls / 4
