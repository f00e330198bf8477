"""Pickles one of its functions with cloudpickle (as joblib, Ray and dask send work to
their workers): by value, with the modules it names.

usage: pickles_functions.py"""

import os
import pickle
import sys
import threading

import cloudpickle
from numpy.random import mtrand


def where():
    return os.getpid(), sys.argv[0], threading.current_thread().name, mtrand.__name__


print(pickle.loads(cloudpickle.dumps(where))() == where())
