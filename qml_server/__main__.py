"""`python -m qml_server ...` is the same as the `qml` command."""

import sys

from qml_server.cli import main

sys.exit(main())
