"""Starts a child (multiprocessing, spawn) that holds the resource tracker's pipe and
sleeps for good, prints its pid, then sleeps for good itself: its timeout ends it."""

import multiprocessing
import time


def sleep_for_good(queue):
    time.sleep(3600)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()  # a semaphore: the resource tracker starts
    child = context.Process(target=sleep_for_good, args=(queue,), daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(3600)
