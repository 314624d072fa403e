"""Stands in for `tyro` in tests that run a benchmark on an image without it: importing it fails."""
raise ImportError("tyro is blocked for this test (tests/blocked/ is on PYTHONPATH)")
