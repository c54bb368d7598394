"""Measurement: categorised memory peaks, throughput, the summary file."""
