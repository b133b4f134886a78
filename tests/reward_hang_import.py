"""A reward module whose import never finishes (module-level code that hangs)."""

import time

while True:
    time.sleep(3600)


def reward(sample) -> float:  # never reached
    return 0.0
