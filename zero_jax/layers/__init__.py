"""Layers of a model: stacked leaves gathered one layer at a time, the prefetching scan, NNX adapters."""
