"""Metric sinks (``logger=``). The local summary.json is always written; loggers mirror it."""
