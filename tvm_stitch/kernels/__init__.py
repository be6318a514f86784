"""A group made a kernel: outlined as one PrimFunc, checked to build, compiled as size variants under one
dispatch where the size calls for it, and packed with independent kernels into one launch."""
