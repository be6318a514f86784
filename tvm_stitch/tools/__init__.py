"""Tools beside the compiler (CLI, bench, fuzz, tune, GPU kit, workloads). The compiler core never imports this package."""
