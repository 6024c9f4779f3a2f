"""``python -m chatkv`` runs the command line (same as the ``chatkv`` script)."""

from chatkv.cli.main import main

main()
