"""``python -m services.gcache --help``: a GCache node (services/gcache/cli.py)."""

from services.gcache.cli import app

if __name__ == "__main__":
    app()
