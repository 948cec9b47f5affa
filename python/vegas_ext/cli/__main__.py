"""``python -m vegas_ext.cli ...`` is the ``vegas`` command."""
import sys

from . import main

sys.exit(main())
