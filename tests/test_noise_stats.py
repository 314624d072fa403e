"""--noise-stats on a minibatch of an odd number of completions (issue 61 item 1(i)): its micro-batches cannot be two
halves, so the run is refused in one line before the model loads (3 completions in micro-batches of 1 logged the
cosine between the first and second of three micro-batches as "the halves'")."""
import sys

import pytest


def test_an_odd_minibatch_is_refused(monkeypatch, tmp_path):
    import gspo

    monkeypatch.setattr(sys, "argv", ["gspo.py", "--output-dir", str(tmp_path), "--num-steps", "1",
                                      "--prompts-per-rank", "1", "--group-size", "3", "--num-minibatches", "1",
                                      "--micro-batch-size", "1", "--noise-stats", "--eval-every", "0",
                                      "--log-samples", "0", "--save-every", "0"])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value.code) == ("error: --noise-stats compares the gradients of each minibatch's two halves: a "
                                 "minibatch of 3 completions has none; make --prompts-per-rank x --group-size / "
                                 "--num-minibatches even")
