"""``python -m plexctl.cli``: the ``plexctl`` console script."""

from plexctl.cli import main

main()
