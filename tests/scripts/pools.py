"""Leaves a thread pool and a process pool open, as many scripts do: python still ends."""
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

threads = ThreadPoolExecutor(2)
processes = ProcessPoolExecutor(1)
print(threads.submit(pow, 2, 10).result(), processes.submit(pow, 3, 3).result(), flush=True)
