"""``python -m stabmon`` runs the command line."""

from stabmon.cli import main

if __name__ == "__main__":
    main()
