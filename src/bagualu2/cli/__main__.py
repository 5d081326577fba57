"""``python -m bagualu2.cli``."""

from . import main

if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports the main module
    main()
