"""Numeric precision (``precision=``): how weights are stored and how compute is cast."""
