"""`python -m fxport.cli ...`: the same as the `fxport` console script."""

from fxport.cli.commands import main

if __name__ == "__main__":
    main()
