"""Activation offloading (``offload=``)."""
