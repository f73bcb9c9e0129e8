"""``python -m lollm.cli``: the same commands as the ``lollm`` script."""

from lollm.cli import main

if __name__ == "__main__":
    main()
