"""Benchmarks run by `livemig bench ...`; each prints figures measured side by side."""
