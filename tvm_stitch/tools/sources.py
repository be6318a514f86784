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

from tvm_stitch.errors import UserInputError


class SourceError(UserInputError):
    """The name or file given to explain does not name a Relax module."""


def _from_script(path: str):
    if not os.path.isfile(path):
        raise SourceError(f"no such file: {path}")
    import tvm

    namespace = _run(path, lambda: runpy.run_path(path, run_name="tvm_stitch_script"), "failed to run")
    if callable(namespace.get("module")):
        mod, where = _run(path, namespace["module"], "module() failed"), "module()"
    elif "mod" in namespace:
        mod, where = namespace["mod"], "mod"
    else:
        raise SourceError(f"{path} defines neither a function module() nor a variable mod")
    if not isinstance(mod, tvm.IRModule):
        raise SourceError(f"{path}: {where} is a {type(mod).__name__}, not a tvm.IRModule")
    return mod


def _run(path: str, call, what: str):
    """`call()`; SourceError naming `path` when the user's code raises or exits."""
    try:
        return call()
    except SystemExit as err:
        raise SourceError(f"{path} {what}: it called sys.exit({err.code!r})") from err
    except Exception as err:  # noqa: BLE001 - any failure of the user's script is reported with its cause
        raise SourceError(f"{path} {what}: {type(err).__name__}: {err}") from err


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
