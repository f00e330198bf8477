"""Sets multiprocessing's start method first thing, as many training scripts do
(`torch.multiprocessing.set_start_method("spawn")`), then uses a pool."""

import multiprocessing as mp
import sys


def square(x):
    return x * x


if __name__ == "__main__":
    mp.set_start_method(sys.argv[1])
    with mp.Pool(2) as pool:
        print(mp.get_start_method(), pool.map(square, range(4)))
