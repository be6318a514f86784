"""The target and TVM device a graph is built for: the given target, or the one its tensors' device implies."""

from __future__ import annotations

import tvm

from tvm_stitch.target import as_target, host_target
from tvm_stitch.torch.errors import UnsupportedDevice


def input_device(example_inputs):
    """The torch device of the graph's tensors (CPU when it has none); mixed devices are refused."""
    import torch

    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise UnsupportedDevice(f"inputs on several devices: {', '.join(sorted(map(str, devices)))}")
    return devices.pop() if devices else torch.device("cpu")


def target_for(device, target=None) -> tvm.target.Target:
    """`target` where given, else llvm for this CPU (host_target) or CUDA for the GPU's compute capability."""
    if target is not None:
        return as_target(target)
    if device.type == "cpu":
        return host_target()
    if device.type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        return as_target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
    raise UnsupportedDevice(f"tensors on {device.type}: tvm-stitch builds for CPUs (llvm) and CUDA GPUs")


def tvm_device(device):
    """The TVM device of a torch device (cpu, cuda:N)."""
    if device.type == "cpu":
        return tvm.cpu()
    if device.type == "cuda":
        return tvm.cuda(device.index or 0)
    raise UnsupportedDevice(f"tensors on {device.type}: tvm-stitch builds for CPUs (llvm) and CUDA GPUs")


def check_target_matches(target: tvm.target.Target, device) -> None:
    """A given target must be for the tensors' device: llvm for CPU tensors, cuda for CUDA ones."""
    wanted = {"cpu": "llvm", "cuda": "cuda"}.get(device.type)
    if target.kind.name != wanted:
        raise UnsupportedDevice(f"target {target.kind.name} for tensors on {device.type}")
