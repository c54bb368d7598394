"""Command-line entry points of memlab (``memlab <command>``)."""
