"""Loaders for other projects' kernels, read at run time from a checkout the
user names; no peer's code is shipped here."""
