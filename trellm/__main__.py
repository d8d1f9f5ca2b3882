"""``python -m trellm ...`` is the ``trellm`` command (for machines where the package
is on the path but not installed, such as the GPU benchmark machine)."""
import sys

from trellm.entrypoints.cli import main

sys.exit(main())
