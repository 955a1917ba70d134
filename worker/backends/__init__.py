"""Compute backends behind one ``Backend`` protocol (``base``): numpy and cupy, with their op
kernels. Owned by the worker's backend thread, the only thread that calls them."""
