"""Parallelism: rank grid (pure Python), process groups, and the TP/PP/DP building blocks."""
