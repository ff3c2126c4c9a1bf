"""Benchmarks for memguard: the model zoo, the CPU ground truth and the accuracy report."""
