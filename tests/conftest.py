"""pytest setup: one thread per process, offline hubs, the ``job`` fixture."""

from memlab_testing import job  # noqa: F401  (fixture)
