import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# the eight objective scripts, as module names (`f"{s}.py"` where a file is meant); every test that means
# "each script" takes this list
SCRIPTS = ["grpo", "gspo", "gspo_token", "dfpo", "cispo", "sapo", "gmpo", "vespo"]
pytest.register_assert_rewrite("helpers")  # its asserts explain themselves as a test's do
# 2 threads (CI's cores); OMP_NUM_THREADS, where set, wins (the scripts the tests start read it too): on a loaded
# machine 1 thread a process avoids OpenMP's spinning, which slowed a small matmul 30x at load 13 on 2 cores
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("OMP_NUM_THREADS"):  # -n N: a worker's share
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model and tokenizer saved to a folder, so scripts run the local-path branch."""
    from grouprl import distributed
    from grouprl import modeling

    path = str(tmp_path_factory.mktemp("tiny"))
    tok = modeling.tiny_tokenizer()
    distributed.seed_everything(0)
    modeling.tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses SmolLM2-135M-Instruct (the real_model_dir fixture; "
                                       "tests/requirements-real-model.txt)")
    config.addinivalue_line("markers", "slow: an end-to-end run that pins no number the fast tests do not; left out of "
                                       "the README's test command (CI), run with -m slow")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(config, items):
    """A test that uses the real model (the real_model_dir fixture) is marked real_model; where the wheel or `gguf`
    is missing, those tests skip, reported in one line (a skip marker: pytest folds them into one line as long as
    the tests carry no decorator marks)."""
    deselect_slow(config, items)
    marked = [item for item in items if "real_model_dir" in getattr(item, "fixturenames", ())]
    if not marked:
        return
    from tools.real_model import missing

    why = missing()
    for item in marked:
        item.add_marker("real_model")
        if why:
            item.add_marker(pytest.mark.skip(reason=f"real model: {why}"))


def deselect_slow(config, items):
    """Without -m, the slow tests are deselected (counted in pytest's summary line); `-m slow` runs only them, `-m
    "slow or not slow"` everything, and a test named by its node id (file::test) always runs."""
    if config.option.markexpr or any("::" in a for a in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct as a plain HF folder, converted once from the wheel's GGUF into $REAL_MODEL_DIR or
    ~/.cache/group-rl (tools/real_model.py; kept there for the next session)."""
    from tools.real_model import build

    return build(quiet=True)
