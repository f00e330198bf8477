"""An unnamed temporary file (O_TMPFILE in the temporary folder), written and read."""

import tempfile

with tempfile.TemporaryFile() as f:
    f.write(b"scratch")
    f.seek(0)
    print(f.read().decode())
