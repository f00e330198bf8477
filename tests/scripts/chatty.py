"""Prints far more than a pipe holds (64 KiB)."""
for i in range(20000):
    print(f"line {i:05d} " + "x" * 40)
print("chatty done")
