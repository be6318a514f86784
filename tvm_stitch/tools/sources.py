"""Where `tvm-stitch explain` gets its Relax module: a suite graph, a model, or a Python script.

- a suite graph name (`layernorm`, `softmax`, ...), built at `dtype` and `size`;
- a model name (`bert`, `gpt2`, `llama`, `convnext`), optionally with a step:
  `gpt2:backward`, `llama:adam` (default `forward`; needs the torch extra);
- a path to a Python script (ending in `.py`) that defines either a function
  `module()` returning a Relax `tvm.IRModule`, or a variable `mod` holding one.
  `module()` wins when both exist.
"""

from __future__ import annotations

import os
import runpy


class SourceError(ValueError):
    """The name or file given to explain does not name a Relax module."""


def _from_script(path: str):
    if not os.path.isfile(path):
        raise SourceError(f"no such file: {path}")
    import tvm

    try:
        namespace = runpy.run_path(path, run_name="tvm_stitch_script")
    except Exception as err:  # noqa: BLE001 - any failure of the user's script is reported with its cause
        raise SourceError(f"{path} failed to run: {type(err).__name__}: {err}") from err
    if callable(namespace.get("module")):
        mod, where = namespace["module"](), "module()"
    elif "mod" in namespace:
        mod, where = namespace["mod"], "mod"
    else:
        raise SourceError(f"{path} defines neither a function module() nor a variable mod")
    if not isinstance(mod, tvm.IRModule):
        raise SourceError(f"{path}: {where} is a {type(mod).__name__}, not a tvm.IRModule")
    return mod


def load_module(spec: str, dtype: str = "float32", size: str = "bench"):
    """(Relax module, one-line description) named by `spec` (see the module docstring)."""
    from tvm_stitch.tools.workloads import SUITE, dims

    if spec.endswith(".py") or os.sep in spec:
        return _from_script(spec), f"script {spec}"
    if spec in SUITE:
        return SUITE[spec].build(dtype, dims(size)), f"suite graph {spec} ({dtype}, {size} size)"
    from tvm_stitch.tools.models import MODELS

    name, _, step = spec.partition(":")
    if name in MODELS:
        from tvm_stitch.tools.model_bench import STEPS, import_step

        step = step or "forward"
        if step not in STEPS:
            raise SourceError(f"unknown step {step!r} of model {name}; steps: {', '.join(STEPS)}")
        if step == "backward" and MODELS[name].no_backward:
            raise SourceError(f"{name} has no backward graph: {MODELS[name].no_backward}")
        try:
            mod = import_step(name, step, size)[0]
        except RuntimeError as err:  # the torch extra is missing
            raise SourceError(str(err)) from err
        return mod, f"model {name} {step} ({MODELS[name].description}; {size} size)"
    raise SourceError(f"unknown graph, model or script {spec!r}: suite graphs: {', '.join(SUITE)}; "
                      f"models: {', '.join(MODELS)} (optionally :backward or :adam); "
                      "or a path to a .py file defining module() or mod")
