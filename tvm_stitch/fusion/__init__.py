"""Convex memory-bound groups, their outlining into one PrimFunc, precision widening, packing of independent kernels."""
