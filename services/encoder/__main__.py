"""``python -m services.encoder --help``: a media encoder (services/encoder/cli.py)."""

from services.encoder.cli import app
from services.lifecycle import run_app

if __name__ == "__main__":
    run_app(app)
