"""Asks at the terminal, as a script with `input()` or a `breakpoint()` does."""

print("listing before the prompt")
try:
    name = input("name? ")
except KeyboardInterrupt:
    print("interrupted at the prompt")
    raise
print(f"hello {name}")
