"""Benchmarks behind ``feddg bench``: one module per subject (model throughput, engines, merges,
data, scale). Numbers go into docs/benchmarks.md with the command that produced them; no test
asserts a speed."""
