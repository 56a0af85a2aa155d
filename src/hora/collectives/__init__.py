"""Collective algorithms on flat NumPy buffers, written against the ``Channel`` interface."""
