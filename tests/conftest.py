import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model and tokenizer saved to a folder, so scripts run the local-path branch."""
    import common
    import distributed

    path = str(tmp_path_factory.mktemp("tiny"))
    tok = common.tiny_tokenizer()
    distributed.seed_everything(0)
    common.tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path
