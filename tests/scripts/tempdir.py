"""Finds the temporary folder afresh: tempfile probes it with os.open under its own lock."""

import tempfile

tempfile.tempdir = None
print("tempdir", tempfile.gettempdir())
