"""Communication: how leaves are laid out over the mesh and moved between devices.

One module a job: `layout` (which dimension of a leaf is split, padding), `axes` (axis
tuples, sizes, varying axes), `collectives` (reduce-scatter and all-gather of leaves and
buckets over the hops of a `Comm` record), `quantize` (ZeRO++'s block-quantized
primitives), `hlo` (reading the collectives out of a compiled program) and `overlap` (a
model of how much of their time a schedule leaves exposed on a given GPU). It sits at the
bottom: it imports nothing of the step.
"""
