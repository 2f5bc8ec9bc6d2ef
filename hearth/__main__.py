"""`python -m hearth`: the `hearth` command, for an environment whose scripts folder is not on PATH."""

from hearth.services.cli import main

if __name__ == "__main__":
    main()
