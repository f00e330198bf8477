"""What a script sees of its own thread: its name, and threading.main_thread() from
it and from a thread it starts (a library's check before it sets signal handlers)."""

import threading

main = threading.main_thread()
print(threading.current_thread().name, threading.current_thread() is main)


def helper():
    print(threading.current_thread().name, "sees the main thread:", threading.main_thread() is main)


thread = threading.Thread(target=helper)
thread.start()
thread.join()
