"""Sequence packing: the planner/packer library (``core``) and the ``packing=`` config options."""
