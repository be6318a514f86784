"""What a scheduled kernel costs on CUDA: its launch geometry (kernel_geometry, derived_geometry), its modeled
global traffic (traffic) and time (modeled_time, plan_prices), and the choices made by that time (timed_choice:
a kernel's configuration; fold_price: a matmul reading through its producers)."""
