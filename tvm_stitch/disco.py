"""`tvm.runtime.disco` set after `import tvm` (TVM 0.27's wheel leaves it None).

`tvm/runtime/__init__.py` imports its `disco` package while `import tvm`
is still loading libraries: the `runtime.disco.DRef` object type is not
registered yet, registering the Python class fails ("Cannot find object
type index for runtime.disco.DRef", a ValueError), and the attribute is
set to None as if Disco were not built. Once `import tvm` is done, the
same import works. `import_disco()` (called when tvm_stitch is imported)
imports it then; where Disco really is missing it stays None.
"""

from __future__ import annotations

import importlib


def import_disco():
    """`tvm.runtime.disco`, imported now if `import tvm` left it None (None where TVM has no Disco)."""
    import tvm

    if getattr(tvm.runtime, "disco", None) is None:
        try:
            tvm.runtime.disco = importlib.import_module("tvm.runtime.disco")
        except (ImportError, ValueError):
            return None
    return tvm.runtime.disco
