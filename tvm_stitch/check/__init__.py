"""Checks of scheduled kernels: they build on their own (builds), their modeled traffic (traffic), and
their execution with SIMT semantics on the CPU (simt_kernel, with opencl_build, launch_geometry,
opencl_semantics, narrow_floats, simt_inputs, guarded_buffers, opencl_run, oclgrind_log)."""
