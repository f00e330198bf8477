"""Asks for a secret at the terminal, as a login (`huggingface_hub.login()`) does."""

import getpass

print("before the secret")
try:
    secret = getpass.getpass("token: ")
except KeyboardInterrupt:
    print("interrupted at the secret")
    raise
print(f"got {secret!r}")
