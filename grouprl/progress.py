"""Progress bars of generation (tqdm, as the training bar): the evaluation's, and a slow step's
rollout's, moved by each decoding step through HF's streamer interface.
"""

import time

import torch
from tqdm import tqdm


class GenBar:
    """A generation's progress bar (rank 0; tqdm, as the training bar): prompts done of this rank's
    share, samples done (rows counted as they stop) and generated tokens a second, moved by each
    decoding step as HF's streamer: put() is given a call's prompt rows once, then each decoding
    step's next token of every row, the pad id for a row that has stopped. delay: shown only once
    that many seconds have passed (a fast step's rollout shows none)."""

    def __init__(self, name: str, prompts: int, n: int, pad_id: int, main: bool, leave: bool,
                 delay: float = 0.0):
        self.bar = tqdm(total=prompts, desc=name, unit="prompt", disable=not main, leave=leave,
                        mininterval=1.0, delay=delay)
        self.n, self.pad_id, self.tokens, self.start = n, pad_id, 0, time.time()
        self.samples, self.stopped = 0, None  # samples of the prompts done; rows of this call

    def put(self, value: torch.Tensor):
        if value.dim() > 1:  # a generate call's prompt rows
            self.stopped = torch.zeros(len(value), dtype=torch.bool)
            return
        self.tokens += int((value != self.pad_id).sum())
        if self.stopped is not None and len(self.stopped) == len(value):
            self.stopped |= value == self.pad_id
        self.show()

    def end(self):
        pass

    def show(self, prompts_done: int = 0, more: str = ""):
        """prompts_done: prompts whose samples are now scored."""
        if prompts_done:
            self.samples, self.stopped = self.samples + prompts_done * self.n, None
        live = 0 if self.stopped is None else int(self.stopped.sum())
        rate = self.tokens / max(time.time() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.samples + live}/{self.bar.total * self.n} samples, "
                                 f"{rate:.0f} tok/s{more}", refresh=False)
        self.bar.update(prompts_done)  # refreshes at most once a second (mininterval)


ROLLOUT_BAR_DELAY = 10.0  # seconds a step's generation runs before its bar shows (a slow step's)
