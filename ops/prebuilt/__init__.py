"""Ops compiled at install time (DS_BUILD_OPS=1) land here."""
