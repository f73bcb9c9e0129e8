"""``python -m lollm``: the same CLI as the ``lollm`` script (torchrun starts it as ``-m lollm``)."""

from lollm.cli import main

if __name__ == "__main__":
    main()
