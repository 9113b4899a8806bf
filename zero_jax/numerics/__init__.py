"""Numerics: precision policies, loss scaling and clipping on split gradients."""
