"""Benchmarks and reports for chatkv (run as ``python -m benchmarks.<name>``)."""
