"""Stands in for `datasets` in tests that run a benchmark on an image without it: importing it fails."""
raise ImportError("datasets is blocked for this test (tests/blocked/ is on PYTHONPATH)")
