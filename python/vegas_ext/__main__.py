"""``python -m vegas_ext ...`` is the ``vegas`` command (see :mod:`vegas_ext.cli`)."""
import sys

from .cli import main

sys.exit(main())
