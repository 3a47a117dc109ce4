"""``python -m services.encoder --help``: a media encoder (services/encoder/cli.py)."""

from services.encoder.cli import app

if __name__ == "__main__":
    app()
