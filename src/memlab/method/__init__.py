"""Training methods (``method=``): what data they read, how batches look, what loss they take."""
