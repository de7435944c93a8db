"""Benchmarks for megatron-ucp (run `python bench/bench_checkpoint.py --help`)."""
