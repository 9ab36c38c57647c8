"""The command line's two views of core: ``calc`` (what will this context cost?) and the terminal's
live table of a ``run``."""
