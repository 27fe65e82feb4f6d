"""`python -m quantkit ...`: the same command line as `quantkit ...` (how torchrun starts each rank)."""

from quantkit.cli import main

main()
