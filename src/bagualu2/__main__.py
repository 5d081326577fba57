"""``python -m bagualu2``: the ``bagualu2`` command."""

from .cli import main

if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports the main module
    main()
