"""``python -m services.gcache --help``: a GCache node (services/gcache/cli.py)."""

from services.gcache.cli import app
from services.lifecycle import run_app

if __name__ == "__main__":
    run_app(app)
