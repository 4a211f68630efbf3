"""`python -m runtime ...` (also what `torchrun -m runtime` runs)."""

from runtime.cli.app import main

main()
