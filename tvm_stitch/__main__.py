"""`python -m tvm_stitch ...`: the same as the `tvm-stitch` command."""

from tvm_stitch.tools.cli import main

raise SystemExit(main())
