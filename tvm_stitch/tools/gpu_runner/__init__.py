"""Files the GPU check kit copies to the GPU machine: run there with only TVM\x27s runtime (not imported here)."""
