"""servelm's own CPU kernels, written in C where torch has no operation that fits.

`build.py` compiles a kernel's source with the system C compiler on first use and caches the
shared library per machine; each kernel module wraps one library for torch tensors and returns
None when it cannot be built, so callers fall back to plain torch.
"""
