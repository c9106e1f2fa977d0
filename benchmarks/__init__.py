"""Benchmarks: figures taken side by side with their floor in one run (DESIGN §4)."""
