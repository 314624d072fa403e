"""Stands in for `trl` in tests that run a benchmark on an image without it: importing it fails."""
raise ImportError("trl is blocked for this test (tests/blocked/ is on PYTHONPATH)")
