"""The math grader and the worker processes that run it and users' --reward functions under a time
bound; called by rewards.score. Which file holds what:
  extract.py      answer extraction: where a completion states its final answer (extract_answer,
                  answer_span)
  equivalence.py  answers compared without math-verify: canonical spellings, exact values, and the
                  fast decision (normalize_answer, parse_number, canonical, decide)
  pool.py         the worker processes and their time bounds (Reward, Rewards, GRADING_WORKERS,
                  in_process_math, worker_path); the worker's own program is ../reward_worker.py
  loading.py      a run's rewards from its flags, checked before any heavy work (load_reward)
This file only re-exports the names used outside the package. A tunable set on the package
(grader.GRADING_WORKERS = 4, as benchmarks/grading.py does) reaches the file that reads it.
"""

import sys
import types

from ..reward_worker import reward_form  # noqa: F401 - API: how a reward function is called
from . import loading, pool
from .equivalence import (MAX_ANSWER_CHARS, canonical, decide, normalize_answer,  # noqa: F401
                          parse_number)
from .extract import answer_span, extract_answer  # noqa: F401
from .loading import IMPORT_TIMEOUT_S, load_reward  # noqa: F401
from .pool import GRADING_WORKERS, Reward, Rewards, in_process_math  # noqa: F401

_TUNABLE = {"GRADING_WORKERS": pool, "IMPORT_TIMEOUT_S": loading}


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _TUNABLE:  # read by the file that holds it, so set there too
            setattr(_TUNABLE[name], name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
