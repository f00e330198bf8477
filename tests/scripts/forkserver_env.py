"""A pool of forkserver workers (Python 3.14's default start method on Linux), each
reporting the environment it runs in."""

import multiprocessing as mp
import os


def tag(_):
    print("worker of", os.environ.get("TAG"), flush=True)
    return os.environ.get("TAG")


if __name__ == "__main__":
    with mp.get_context("forkserver").Pool(1) as pool:
        print("got", pool.map(tag, [0]))
