"""`python -m tvm_stitch ...`: the same as the `tvm-stitch` command."""

from .cli import main

raise SystemExit(main())
