"""A tools file that misbehaves as it is imported, in the way the environment variable BAD_IMPORT
names: 'exit' (sys.exit(3)), 'die' (os._exit(0)), 'hang' (sleeps ten minutes); else it imports
cleanly. tests/test_episodes.py's probe test: the trainer must say so in one line, not exit silently
or hang (tools.py imports the file first in a worker of its own)."""
import os
import sys
import time

MODE = os.environ.get("BAD_IMPORT", "")
if MODE == "exit":
    sys.exit(3)
if MODE == "die":
    os._exit(0)
if MODE == "hang":
    time.sleep(600)


def echo(text: str) -> str:
    """Say text back.

    Args:
        text: what to say
    """
    return text
