"""Stands in for `math_verify` in tests that run a benchmark on an image without it: importing it fails."""
raise ImportError("math_verify is blocked for this test (tests/blocked/ is on PYTHONPATH)")
