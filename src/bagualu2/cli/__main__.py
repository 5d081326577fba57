"""``python -m bagualu2.cli``."""

from .app import main

main()
